"""Reading llama.cpp's GGUF files: the config and tokenizer from the metadata, the tensors
dequantized at load, under Hugging Face names.

A GGUF file is one file where a Hugging Face checkpoint is a folder. `prepare_gguf` derives
the folder's config.json and tokenizer files once (into the user cache, keyed by the file's
path, size and modification time) so the tokenizer and detokenizer processes load them as
they load any checkpoint's; `GGUFTensors` gives the loader the file's tensors under the names
`models/loader.py` maps from safetensors. Nothing here unpickles: GGUF is a typed binary
format, read through the `gguf` package's memory-mapped reader.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (its rotary
pairs adjacent dimensions, ours rotates halves); `_unpermute` puts them back. Qwen2 and Qwen3
files are written unpermuted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minisgl_mp.models.gguf_layout import check_layout

# GGUF's general.architecture -> (Hugging Face model_type, architectures[0]).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# Bumped when what prepare_gguf writes changes, so stale cache folders are rebuilt.
PREPARE_VERSION = "2"

# llama.cpp tensor name -> Hugging Face name ({} is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# Stacked expert tensors [E, rows, cols]: split into transformers' per-expert names.
_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)  # llama-gguf-split's file names
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# llama.cpp stores Llama 3's rope scaling as per-frequency divisors, not as parameters.
ROPE_FREQS = "rope_freqs.weight"


class GGUFError(ValueError):
    """A GGUF file that cannot be served, with a message that names the file and the reason."""


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def find_gguf(folder: Path) -> Path | None:
    """The one GGUF file in `folder`; None when there is none. Several (one model in different
    quantizations, as hub repositories ship them) is an error: the user names the file."""
    files = sorted(p for p in folder.iterdir() if is_gguf(p) and p.is_file())
    if len(files) > 1 and all(_SPLIT.search(p.name) for p in files):
        raise GGUFError(f"{folder} holds one GGUF model split into {len(files)} files ({files[0].name}, ...), "
                        "which is not served split: merge them into one first (llama-gguf-split --merge "
                        f"{files[0]} merged.gguf)")
    if len(files) > 1:
        raise GGUFError(f"{folder} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
                        "pass the one to serve: --model " + str(files[0]))
    return files[0] if files else None


def open_reader(file: Path) -> Any:
    """The gguf package's reader over `file`, or GGUFError for a file it cannot parse
    (truncated, not GGUF, a newer format version)."""
    from gguf import GGUFReader

    size = file.stat().st_size
    if size == 0:
        raise GGUFError(f"{file}: empty file, not a GGUF model")
    try:
        return GGUFReader(str(file))
    except Exception as e:  # the reader raises ValueError, struct/index errors or numpy's on bad bytes
        said = f"{type(e).__name__}: {e}"
        if "magic" in str(e):
            raise GGUFError(f"{file}: not a GGUF file (it does not start with the bytes 'GGUF')") from None
        if "GGMLQuantizationType" in str(e):  # a tensor type id the enum lacks
            raise GGUFError(f"{file}: a tensor is stored in a type the installed gguf package does not "
                            f"know ({said}); a newer llama.cpp type?") from None
        raise GGUFError(f"{file}: truncated or corrupt GGUF file ({size} bytes; the reader says {said})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return default if value is None else value


def _architecture(reader: Any, file: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def check_tensor_types(reader: Any, file: Path) -> None:
    """Every tensor's type is one the gguf package can dequantize, or GGUFError naming it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for t in reader.tensors:
        if t.tensor_type not in plain and t.tensor_type not in _type_traits:
            raise GGUFError(f"{file}: tensor {t.name!r} is stored as {t.tensor_type.name}, a quantization type "
                            "the gguf package cannot dequantize")


def hf_config(reader: Any, file: Path) -> dict[str, Any]:
    """A Hugging Face config.json for the model in the file, from its metadata (and, where the
    metadata is silent, from which tensors it holds)."""
    arch = _architecture(reader, file)
    model_type, architecture = ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    missing = [k for k in ("block_count", "embedding_length", "attention.head_count") if key(k) is None]
    if missing:
        raise GGUFError(f"{file}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{file}: no token_embd.weight tensor")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size") or (len(tokens.data) if tokens is not None else int(embed.shape[1])))
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    elif arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = False
    if arch == "qwen3moe":
        cfg |= {"num_experts": int(key("expert_count", 0)), "num_experts_per_tok": int(key("expert_used_count", 0)),
                "moe_intermediate_size": int(key("expert_feed_forward_length", 0)),
                # llama.cpp always renormalises Qwen3-MoE's top-k weights.
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        if not cfg["intermediate_size"]:
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        factor = float(key("rope.scaling.factor", 1.0))
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        if scaling == "yarn":
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    elif scaling not in (None, "none"):
        raise GGUFError(f"{file}: rope scaling type {scaling!r} is not supported (supported: none, linear, yarn)")
    if ROPE_FREQS in names:
        divisors = dequantized(next(t for t in reader.tensors if t.name == ROPE_FREQS)).reshape(-1)
        # Not a transformers key: models/config.py reads it into the rotary embedding.
        cfg["rope_freq_divisors"] = [float(x) for x in divisors]
    for field, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{field}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, in PyTorch's dimension order (GGUF lists dimensions innermost
    first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type == GGMLQuantizationType.F32:
        data = np.asarray(tensor.data, dtype=np.float32)
    else:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return data.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, 1, 2, 3, ...) of pairs back to halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """Our loader's (Hugging Face) name for a GGUF tensor; None for one we read elsewhere."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


class GGUFTensors:
    """The file's tensors under Hugging Face names, for `models/loader.py`: the subset of
    safetensors' `safe_open` handle it uses (`keys`, `get_tensor`, `get_slice`). Each tensor is
    dequantized when asked for; stacked expert tensors are dequantized once and handed out per
    expert."""

    def __init__(self, file: Path, num_heads: int, num_kv_heads: int):
        self._reader = open_reader(file)
        self._arch = _architecture(self._reader, file)
        check_tensor_types(self._reader, file)
        self._heads, self._kv_heads = num_heads, num_kv_heads
        self._by_name: dict[str, tuple[Any, int | None]] = {}  # HF name -> (GGUF tensor, expert)
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._by_name[name] = (t, None)
                continue
            m = _BLOCK.match(t.name)
            if m and m.group(2) in _EXPERT_NAMES:
                for e in range(int(t.shape[-1])):
                    proj = _EXPERT_NAMES[m.group(2)]
                    self._by_name[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight"] = (t, e)
            elif t.name != ROPE_FREQS:
                raise GGUFError(f"{file}: tensor {t.name!r} has no counterpart in a {self._arch} model")
        self._stacked: tuple[str, np.ndarray] | None = None  # the last expert tensor dequantized

    def keys(self) -> list[str]:
        return list(self._by_name)

    def get_tensor(self, name: str) -> Any:
        import torch

        tensor, expert = self._by_name[name]
        if expert is not None:
            if self._stacked is None or self._stacked[0] != tensor.name:
                self._stacked = (tensor.name, dequantized(tensor))
            return torch.from_numpy(np.ascontiguousarray(self._stacked[1][expert]))
        data = self._rows_in_our_order(tensor, dequantized(tensor))
        # A float32 tensor is a read-only view of the memory-mapped file: copied, not aliased.
        return torch.from_numpy(np.array(data, order="C", copy=not data.flags.writeable or None))

    def _rows_in_our_order(self, tensor: Any, data: np.ndarray) -> np.ndarray:
        if self._arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            return _unpermute(data, self._heads if "attn_q" in tensor.name else self._kv_heads)
        return data

    def int4_blocks(self, name: str) -> Any:
        """The tensor's Q4_0 / Q4_1 blocks as int4 blocks, rows in our order (models/gguf_blocks.py);
        None for any other type, and for experts' tensors."""
        from minisgl_mp.models.gguf_blocks import int4_blocks

        tensor, expert = self._by_name[name]
        if expert is not None:
            return None
        return int4_blocks(tensor, lambda rows: self._rows_in_our_order(tensor, rows))

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.get_tensor(name))

    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stacked = None


@dataclass
class _Slice:
    """safetensors' slice handle over a tensor already in memory (GGUF blocks cannot be read
    by row range without dequantizing them)."""

    tensor: Any

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> Any:
        return self.tensor[index].contiguous()


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "minisgl_mp" / "gguf"


def _cache_key(file: Path) -> str:
    st = file.stat()
    ident = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{PREPARE_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def prepare_gguf(file: Path, need_tokenizer: bool = True) -> Path:
    """The folder with config.json and the tokenizer files derived from `file`'s metadata,
    written on first use. Checks the architecture, every tensor's type and the tensors' names
    and shapes up front, so a file that cannot be served fails here, before any process starts.
    A file without a vocabulary gets no tokenizer files: an error unless the caller has a
    tokenizer of its own (`need_tokenizer` False: --tokenizer, as vLLM takes one)."""
    out = _cache_root() / f"{file.stem}-{_cache_key(file)}"
    if not (out / "config.json").exists():
        _prepare(file, out)
    if need_tokenizer and not (out / "tokenizer_config.json").exists():
        raise GGUFError(f"{file}: GGUF metadata lacks tokenizer.ggml.tokens, so the file has no vocabulary; "
                        "pass --tokenizer with a folder or hub id that holds its tokenizer")
    return out


def _prepare(file: Path, out: Path) -> None:
    reader = open_reader(file)
    parts, part = int(_field(reader, "split.count", 1)), int(_field(reader, "split.no", 0)) + 1
    if parts > 1:
        first = file.with_name(file.name.replace(f"-{part:05d}-of-", "-00001-of-"))
        raise GGUFError(f"{file}: part {part} of a GGUF model split into {parts} files, which is not served "
                        f"split: merge them into one first (llama-gguf-split --merge {first} merged.gguf)")
    config = hf_config(reader, file)
    check_tensor_types(reader, file)
    check_layout(reader, config, file, optional=(ROPE_FREQS,))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        if "tokenizer.ggml.tokens" in reader.fields:
            _write_tokenizer(file, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (staging / "source.json").write_text(json.dumps({"gguf": str(file.resolve())}) + "\n", encoding="utf-8")
        try:
            staging.rename(out)
        except OSError:  # another process prepared it first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_tokenizer(file: Path, out: Path) -> None:
    """The file's tokenizer and chat template as Hugging Face tokenizer files, converted by
    transformers (the reference for what the GGUF vocabulary means)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise GGUFError(f"{file}: its tokenizer metadata cannot be read ({type(e).__name__}: {e})") from None
    tok.save_pretrained(str(out))
