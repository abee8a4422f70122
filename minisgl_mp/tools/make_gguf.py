"""Writes a small random GGUF file the way llama.cpp's convert_hf_to_gguf.py writes a real model's:
its metadata keys, its tensor names, Llama's q/k row permutation, 1-D tensors and the MoE router
kept in F32, every other matrix in the tensor type asked for. For tests of GGUF loading.

    python -m minisgl_mp.tools.make_gguf --arch qwen3 --type Q4_K --out /tmp/q3/model.gguf

The weights are make_model's random ones (varied greedy output) for a shape small enough to
load in a second; the tokenizer is make_model's byte-level BPE (8000 tokens plus Qwen's special
and markup tokens) and the chat template Qwen3's. Names come from the gguf package's
TensorNameMap, the table the converter uses, not from our loader's.

The gguf package quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; for the K-quants
it only dequantizes, so Q4_K and Q6_K are encoded here (a plain round-to-nearest per block, not
llama.cpp's search for the best scales: a valid file, a little less accurate).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl_mp.tools.make_model import ModelShape, arch_config, random_weights
from minisgl_mp.tools.make_tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, ENDOFTEXT, IM_END, train_tokenizer
from minisgl_mp.tools.qwen3_template import QWEN3_CHAT_TEMPLATE

# GGUF's general.architecture -> make_model's --arch.
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
QK_K = 256  # a K-quant block: every row length must be a multiple of it

# One shape for every architecture: each row length (hidden, q_size, intermediate, the experts'
# width) is a multiple of 256, so every type above applies to every matrix.
SMALL = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "hidden_act": "silu", "torch_dtype": "float32",
}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
# Tied like Llama 3.2 / SmolLM2 and Qwen3-0.6B; untied like Qwen2.5-7B and Qwen3-30B-A3B.
TIED = {"llama": True, "qwen2": False, "qwen3": True, "qwen3moe": False}
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2"}


def hf_config(arch: str, num_layers: int = 2, vocab_size: int = 8009) -> dict[str, Any]:
    """The Hugging Face config.json the file states, as transformers would read it back."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    base = SMALL | {"num_hidden_layers": num_layers, "vocab_size": vocab_size, "tie_word_embeddings": TIED[arch],
                    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    config = arch_config(base, ARCHS[arch])
    if arch == "qwen3moe":
        config |= MOE
    return config


@functools.lru_cache(maxsize=1)
def _tokenizer() -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, llama.cpp token types, merges) of make_model's tokenizer (trained once)."""
    tok = train_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    # llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined (added, not special).
    types = [3 if t in SPECIAL_TOKENS else 4 if t in MARKUP_TOKENS else 1 for t in tokens]
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, the rotary halves' rows interleaved
    into adjacent pairs (llama.cpp's rope rotates pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks [..., cols / 256 * 144] as uint8: per 256 values an f16 scale and min, eight
    6-bit sub-block scales and mins (packed in 12 bytes), 4-bit values; x = d*sc*q - dmin*m."""
    x = rows.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)  # [n, 8]: the offset is a non-negative multiple of -dmin
    step = (x.max(-1) - lo) / 15
    d, dmin = _f16(step.max(-1) / 63), _f16(-lo.min(-1) / 63)  # [n]
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint(_safe_div(x + offset[..., None], scale[..., None])), 0, 15).astype(np.uint8)
    # gguf's Q4_K.get_scale_min layout: bytes 0-3 scales 0-3 (+ high bits of 4-7), 4-7 mins 0-3
    # (+ high bits of 4-7), 8-11 the low nibbles of scales and mins 4-7.
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=-1)
    q = q.reshape(-1, 4, 2, 32)  # 64 values per 32 bytes: low nibbles, then high nibbles
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, qs], axis=-1)
    return blocks.reshape(*rows.shape[:-1], rows.shape[-1] // QK_K * 144)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks [..., cols / 256 * 210] as uint8: 6-bit values split into 4 low bits (ql) and
    2 high bits (qh), sixteen int8 sub-block scales, an f16 scale; x = d*sc*(q - 32)."""
    x = rows.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(x).max(-1) / 31  # [n, 16]
    d = _f16(step.max(-1) / 127)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_safe_div(x, scale[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (q & 0xF).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=-1)
    return blocks.reshape(*rows.shape[:-1], rows.shape[-1] // QK_K * 210)


def encode(data: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(the array to write, its raw GGML type or None for a plain float array)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == "F32":
        return data.astype(np.float32), None
    if qtype == "F16":
        return data.astype(np.float16), None
    if qtype == "Q4_K":
        return quantize_q4_k(data), GGMLQuantizationType.Q4_K
    if qtype == "Q6_K":
        return quantize_q6_k(data), GGMLQuantizationType.Q6_K
    t = GGMLQuantizationType[qtype]
    return quantize(data, t), t


def _file_type(qtype: str) -> int:
    from gguf import LlamaFileType

    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_K": "MOSTLY_Q4_K_M",
             "Q6_K": "MOSTLY_Q6_K"}
    return int(LlamaFileType[names.get(qtype, f"MOSTLY_{qtype}")])


def write_gguf(out: str | Path, arch: str, qtype: str, *, num_layers: int = 2, seed: int = 0,
               omit: Collection[str] = ()) -> Path:
    """Write the file `out` and return its path. `omit`: tensor names or metadata keys to leave
    out (for tests of incomplete files)."""
    import gguf

    if qtype not in TYPES:
        raise ValueError(f"unknown tensor type {qtype!r}; expected one of {', '.join(TYPES)}")
    tokens, token_types, merges = _tokenizer()
    config = hf_config(arch, num_layers, len(tokens))
    shape = ModelShape.from_config(config)
    weights = random_weights(shape, seed)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], num_layers)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"{arch}-tiny-random")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(num_layers)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    if arch == "llama":  # what LlamaModel.set_gguf_parameters adds
        w.add_vocab_size(len(tokens))
        w.add_rope_dimension_count(config["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(MOE["num_experts"])
        w.add_expert_used_count(MOE["num_experts_per_tok"])
        w.add_expert_feed_forward_length(MOE["moe_intermediate_size"])
    w.add_file_type(_file_type(qtype))
    if qtype not in ("F32", "F16", "BF16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER[arch])
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(ENDOFTEXT))
    w.add_eos_token_id(tokens.index(IM_END))
    w.add_pad_token_id(tokens.index(ENDOFTEXT))
    w.add_add_bos_token(arch == "llama")  # Llama 3 files prepend <|begin_of_text|>; Qwen's do not
    w.add_chat_template(QWEN3_CHAT_TEMPLATE)
    for key in omit:
        w.kv_data[0].pop(key, None)

    experts: dict[tuple[int, str], list[np.ndarray]] = {}
    for hf_name, tensor in weights.items():
        data = tensor.to(torch.float32).numpy()
        if ".experts." in hf_name:  # stacked [E, rows, cols] per layer and projection, as the converter does
            parts = hf_name.split(".")  # model.layers.<i>.mlp.experts.<e>.<proj>.weight
            layer, expert, proj = parts[2], parts[5], parts[6]
            experts.setdefault((int(layer), proj), []).append(data)
            if int(expert) == MOE["num_experts"] - 1:
                _add(w, names, f"model.layers.{layer}.mlp.experts.{proj}.weight",
                     np.stack(experts.pop((int(layer), proj))), qtype, omit)
            continue
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            data = _permute(data, heads)
        _add(w, names, hf_name, data, qtype, omit)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w: Any, names: Any, hf_name: str, data: np.ndarray, qtype: str, omit: Collection[str]) -> None:
    stem, suffix = hf_name.rsplit(".", 1)
    name = names.get_name(stem)
    if name is None:
        raise ValueError(f"no llama.cpp name for {hf_name}")
    name = f"{name}.{suffix}"
    if name in omit:
        return
    # llama.cpp keeps 1-D tensors (norms, biases) and the MoE router in F32.
    kept = data.ndim == 1 or name.endswith("ffn_gate_inp.weight")
    array, raw = encode(data, "F32" if kept else qtype)
    w.add_tensor(name, array, raw_dtype=raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), required=True)
    ap.add_argument("--type", choices=TYPES, default="Q8_0", help="the matrices' tensor type (default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = write_gguf(args.out, args.arch, args.type, num_layers=args.layers, seed=args.seed)
    print(f"wrote {out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
