"""The generated checkpoint's tokenizer: a byte-level BPE trained offline, deterministically,
on text that ships with Python, with Qwen's special tokens, tool and think markers,
pre-tokenizer and Qwen3's chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from minisgl_mp.tools.qwen3_template import QWEN3_CHAT_TEMPLATE

# Special tokens come right after the BPE vocabulary, as in Qwen (151643 BPE tokens, then
# <|endoftext|>=151643, <|im_start|>=151644, <|im_end|>=151645): here 8000, 8001, 8002.
BPE_VOCAB_SIZE = 8000
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen3's tool and think markers, one token each right after the special tokens (8003-8008),
# added as Qwen3's tokenizer adds them: special=False, so skip_special_tokens keeps them in
# the text, where the tool-call and reasoning parsers find them.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Prose-heavy stdlib sources present in every CPython >= 3.10, read in this fixed order.
# Their text differs between Python versions, so the tokenizer is only reproducible per version.
CORPUS_MODULES = (
    "argparse", "textwrap", "typing", "subprocess", "threading",
    "functools", "dataclasses", "inspect", "difflib", "doctest",
)  # fmt: skip



def train_tokenizer() -> Tokenizer:
    """Byte-level BPE with Qwen's normalizer, pre-tokenizer and decoder (~0.6 s, deterministic)."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    for module in CORPUS_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"stdlib module {module} has no source file to train the tokenizer on")
        texts.append(Path(spec.origin).read_text(encoding="utf-8"))
    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, not {BPE_VOCAB_SIZE}")
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        }  # fmt: skip
        for token in SPECIAL_TOKENS
    } | {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": False,
        }  # fmt: skip
        for token in MARKUP_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }


def check_special_ids(config: dict[str, Any], tokenizer: Tokenizer) -> None:
    # The checkpoint ships this tokenizer, so the config's ids must name its special tokens.
    expected = {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT}
    for key, token in expected.items():
        want = tokenizer.token_to_id(token)
        if key in config and config[key] != want:
            raise ValueError(
                f"config {key} is {config[key]}, but the generated tokenizer has {token} at {want}; "
                "a generated checkpoint ships that tokenizer, so point the config's ids at it"
            )
    if config["vocab_size"] < tokenizer.get_vocab_size():
        size = tokenizer.get_vocab_size()
        raise ValueError(f"vocab_size {config['vocab_size']} is below the tokenizer's {size}")


def generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    # Qwen3 stops on <|im_end|> or <|endoftext|>. Greedy by default: the weights are random,
    # so sampling defaults would only make demos and comparisons non-reproducible.
    end, im_end = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    return {"bos_token_id": end, "eos_token_id": [im_end, end], "pad_token_id": end, "do_sample": False}
