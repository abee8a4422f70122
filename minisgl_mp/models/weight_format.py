"""Storing a loaded model's weights in a smaller format: float16 / bfloat16, int8 weight-only
with one float32 scale per output channel (symmetric, absmax / 127: llama.cpp's q8_0 keeps a
scale per 32 weights instead), or int4 blocks of 32 weights with a float16 scale and minimum
each (llama.cpp's Q4_1, kernels/int4.py). Only the Linear layers and the embedding table
change; norms, activations and the KV cache keep the model's dtype, and products widen on the
fly.

Done once after loading, from the float checkpoint: the model is briefly whole in its float
dtype, then each layer's weight is replaced (the float copy freed) one at a time. From a GGUF
file, int4 takes the file's own Q4_0 / Q4_1 blocks where it has them (`file_blocks`, collected
by the loader: the same values, not quantized twice) and stores the file's other tensors, which
it kept at a higher precision (SmolLM2's Q4_1 file: its tied embedding, as Q8_0), as int8.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.kernels import int4
from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear

STORED_DTYPES = (torch.float16, torch.bfloat16, torch.int8, int4.STORAGE_DTYPE)
# A parameter's int4 blocks from the file, by our parameter name: [out, in / 32 * 20].
FileBlocks = dict[str, torch.Tensor]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q [out, in] int8, scale [out] float32) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = wf.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _stored(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dtype == torch.int8:
        return quantize_int8(w)
    if dtype == int4.STORAGE_DTYPE:
        return int4.quantize(w), None
    return w.to(dtype), None


def _check_int4(model: nn.Module) -> None:
    """Every weight int4 would store has whole blocks of 32 inputs, or a ValueError naming one."""
    for name, m in model.named_modules():
        k = m.in_features if isinstance(m, Linear) else m.dim if isinstance(m, VocabEmbedding) else None
        if k is not None and k % int4.GROUP:
            raise ValueError(f"--quantization int4 stores weights in blocks of {int4.GROUP} inputs, but {name or 'the model'} "
                             f"has {k} inputs (not a multiple of {int4.GROUP}): use --quantization int8")


def store_weights(model: nn.Module, dtype: torch.dtype, file_blocks: FileBlocks | None = None) -> int:
    """Store every Linear weight and embedding table of `model` in `dtype` (one of
    STORED_DTYPES); a tied LM head and embedding keep sharing one tensor. `file_blocks` (int4
    from a GGUF file): the file's int4 blocks by parameter name; a weight without them is stored
    as int8. Returns the number of tensors converted."""
    if dtype not in STORED_DTYPES:
        raise ValueError(f"weights can be stored as {STORED_DTYPES}, not {dtype}")
    if dtype == int4.STORAGE_DTYPE:
        _check_int4(model)

    def stored(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if file_blocks is None:
            return _stored(w, dtype)
        blocks = file_blocks.get(name)
        return (blocks.contiguous(), None) if blocks is not None else quantize_int8(w)

    named = list(model.named_modules())
    embeddings = [(n, m) for n, m in named if isinstance(m, VocabEmbedding)]
    done = 0
    tied: set[int] = set()  # embeddings given their LM head's stored tensor
    for name, m in named:
        if isinstance(m, Linear) and m.weight.dtype != dtype:
            sharers = [e for _, e in embeddings if e.weight is m.weight]
            key = f"{name}.weight"
            if sharers and file_blocks is not None:  # tied: the file holds it as the embedding
                key = next(f"{n}.weight" for n, e in embeddings if e.weight is m.weight)
            m.store_weight(*stored(key, m.weight.data))
            for e in sharers:
                e.store_weight(m.weight, m.weight_scale)
                tied.add(id(e))
            done += 1
    for name, e in embeddings:
        if e.weight.dtype != dtype and id(e) not in tied:
            e.store_weight(*stored(f"{name}.weight", e.weight.data))
            done += 1
    return done
