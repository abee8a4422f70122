"""The int4 weight format: llama.cpp's Q4_1 blocks, as GGUF files store them.

A weight [N, K] is held as bytes [N, K / 32 * 20], each output channel's row a run of blocks of
32 inputs: float16 scale d, float16 minimum m, then 16 bytes whose low nibbles are the block's
inputs 0-15 and high nibbles inputs 16-31 (q in 0..15); the weight is d * q + m, in float32.
That is 5 bits a weight, a fifth of float32's bytes. A GGUF file's Q4_1 tensors are this layout
byte for byte, and its Q4_0 ones (q - 8 times d) are it with m = -8 d, exactly
(models/gguf_blocks.py); float tensors are quantized here. The C product kernel reads the blocks
as they are (kernels/csrc/weight_gemm.c, FMT_Q4).
"""

from __future__ import annotations

import torch

GROUP = 32  # inputs per block (along K)
BLOCK_BYTES = 20
# What a stored int4 weight's tensor holds (its bytes), and the weight dtype that asks for int4.
STORAGE_DTYPE = torch.uint8


def row_bytes(in_features: int) -> int:
    """Bytes of one output channel's blocks; in_features must be a multiple of GROUP."""
    if in_features % GROUP:
        raise ValueError(f"int4 weights need a multiple of {GROUP} inputs, got {in_features}")
    return in_features // GROUP * BLOCK_BYTES


def in_features_of(blocks: torch.Tensor) -> int:
    """The inputs (K) of a weight held as int4 blocks [..., K / 32 * 20]."""
    if blocks.dtype != STORAGE_DTYPE or blocks.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"not int4 blocks: {blocks.dtype} {tuple(blocks.shape)}")
    return blocks.shape[-1] // BLOCK_BYTES * GROUP


def quantize(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float -> int4 blocks [N, K / 32 * 20]: per block of 32 inputs, d = (max - min) / 15
    and m = min rounded to float16, then each q the nearest step of that grid (round to
    nearest, clamped to 0..15). A constant block has d = 0 and holds its value in m."""
    n, k = w.shape
    size = row_bytes(k)
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    d32, m32 = d.float(), m.float()
    q = torch.where(d32 > 0, torch.round((g - m32) / torch.where(d32 > 0, d32, 1.0)), 0.0).clamp_(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d.view(torch.uint8), m.view(torch.uint8), nibbles], dim=-1)  # [N, K / 32, 20]
    return blocks.reshape(n, size)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """int4 blocks [..., K / 32 * 20] -> float32 [..., K]: d * q + m, the multiply and the add each
    rounded to float32 (as llama.cpp's reference and the gguf package compute it)."""
    k = in_features_of(blocks)
    b = blocks.reshape(*blocks.shape[:-1], k // GROUP, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return (d * q + m).reshape(*blocks.shape[:-1], k)
