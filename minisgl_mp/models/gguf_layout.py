"""Which tensors, of which shapes, a GGUF file must hold for the config its metadata states.

Checked when the file is first prepared (in the launcher, before any process starts), so a file
with a tensor missing, misnamed or of the wrong shape fails in a second with a message naming the
tensor and the file, rather than in the scheduler process after the weights start loading.
Names are llama.cpp's; shapes are PyTorch's order ([out, in]), GGUF's reversed.
"""

from __future__ import annotations

from typing import Any

Shape = tuple[int, ...]


def expected_shapes(cfg: dict[str, Any]) -> dict[str, Shape]:
    """llama.cpp tensor name -> shape for a Hugging Face config dict (as gguf.hf_config writes it)."""
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    moe = cfg.get("num_experts", 0)
    out: dict[str, Shape] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,), b + "attn_q.weight": (q, h),
                b + "attn_k.weight": (kv, h), b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, q)}
        if cfg.get("attention_bias"):
            out |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            out |= {b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,)}
        if moe:
            inter = cfg["moe_intermediate_size"]
            out |= {b + "ffn_gate_inp.weight": (moe, h), b + "ffn_gate_exps.weight": (moe, inter, h),
                    b + "ffn_up_exps.weight": (moe, inter, h), b + "ffn_down_exps.weight": (moe, h, inter)}
        else:
            inter = cfg["intermediate_size"]
            out |= {b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h),
                    b + "ffn_down.weight": (h, inter)}
    return out


def check_layout(reader: Any, cfg: dict[str, Any], file: Any, optional: tuple[str, ...] = ()) -> None:
    """Every tensor the config needs is in the file with its shape, and the file holds nothing
    else (but `optional` names), or ValueError naming the first tensors that are wrong."""
    from minisgl_mp.models.gguf import GGUFError

    want = expected_shapes(cfg)
    have = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    arch = f"{cfg['model_type']} model of {cfg['num_hidden_layers']} blocks"
    missing = [n for n in want if n not in have]
    if missing:
        raise GGUFError(f"{file}: tensor(s) missing for a {arch}: {_names(missing)}")
    unknown = [n for n in have if n not in want and n not in optional]
    if unknown:
        raise GGUFError(f"{file}: tensor(s) with no counterpart in a {arch}: {_names(unknown)}")
    for name, shape in want.items():
        if have[name] != shape:
            raise GGUFError(f"{file}: tensor {name!r} has shape {have[name]}, but the metadata implies {shape}")


def _names(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
