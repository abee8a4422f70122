"""Storing a loaded model's weights in a smaller format: float16 / bfloat16, or int8 weight-only
with one float32 scale per output channel (symmetric, absmax / 127: llama.cpp's q8_0 keeps a
scale per 32 weights instead). Only the Linear layers and the embedding table change; norms,
activations and the KV cache keep the model's dtype, and products widen on the fly.

Done once after loading, from the float checkpoint: the model is briefly whole in its float
dtype, then each layer's weight is replaced (the float copy freed) one at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear

STORED_DTYPES = (torch.float16, torch.bfloat16, torch.int8)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q [out, in] int8, scale [out] float32) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = wf.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _stored(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    return quantize_int8(w) if dtype == torch.int8 else (w.to(dtype), None)


def store_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every Linear weight and embedding table of `model` in `dtype` (one of
    STORED_DTYPES); a tied LM head and embedding keep sharing one tensor. Returns the number
    of tensors converted."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"weights can be stored as {STORED_DTYPES}, not {dtype}")
    modules = list(model.modules())
    embeddings = [m for m in modules if isinstance(m, VocabEmbedding)]
    done = 0
    for m in modules:
        if isinstance(m, Linear) and m.weight.dtype != dtype:
            sharers = [e for e in embeddings if e.weight is m.weight]
            m.store_weight(*_stored(m.weight.data, dtype))
            for e in sharers:
                e.store_weight(m.weight, m.weight_scale)
            done += 1
    for e in embeddings:
        if e.weight.dtype != dtype:
            e.store_weight(*_stored(e.weight.data, dtype))
            done += 1
    return done
