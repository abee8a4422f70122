"""q and k of a fused qkv projection, each head RMS-normed (Qwen3) or not (Llama, Qwen2), then
rotated: the attention input.

One C pass over the projection on the CPU when the norms run their C kernels (float32; see
`RMSNorm.enable_cpu_kernels`; without norms, when the rotary table does), one Triton kernel on
CUDA when the norms run theirs (`RMSNorm.enable_triton_kernels`), the PyTorch ops otherwise: the
model calls this and stays the same on every device. The one-call CPU step
(`engine/cpu_decode.py`) runs the same C pass, so both give the same bits.
"""

from __future__ import annotations

import torch

from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.layers.rotary import RotaryEmbedding


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                 rope: RotaryEmbedding, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq + 2 Hkv) * D], rows q | k | v -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D].
    q_norm and k_norm are both given (Qwen3) or both None (no per-head norm)."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    v = qkv[:, q_size + kv_size :].reshape(t, num_kv_heads, head_dim)
    c_kernels = rope.cpu_kernels if q_norm is None or k_norm is None else q_norm.cpu_kernels and k_norm.cpu_kernels
    if c_kernels and qkv.dtype == torch.float32 and qkv.is_contiguous() and head_dim % 2 == 0:
        q, k = cpu_kernels.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim,
                                        None if q_norm is None else q_norm.weight,
                                        None if k_norm is None else k_norm.weight,
                                        0.0 if q_norm is None else q_norm.eps, rope.cos_sin, positions)
        return q, k, v
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    if q_norm is None or k_norm is None:
        return *rope(positions, q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim)), v
    if q_norm.triton_kernels and k_norm.triton_kernels and qkv.stride(-1) == 1 and head_dim % 2 == 0:
        from minisgl_mp.kernels import triton_ops

        q, k = triton_ops.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, q_norm.weight, k_norm.weight,
                                       q_norm.eps, rope.cos_sin, positions)
        return q, k, v
    q = q_norm(q.reshape(t, num_heads, head_dim))
    k = k_norm(k.reshape(t, num_kv_heads, head_dim))
    q, k = rope(positions, q, k)
    return q, k, v
