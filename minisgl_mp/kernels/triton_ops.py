"""The layer's small element-wise steps fused into one Triton kernel each, for the CUDA path:
the residual add with RMSNorm, Qwen3's per-head q/k RMSNorm with the rotary embedding, and
SwiGLU's silu(gate) * up. The same three as the CPU's C kernels (kernels/cpu.py), with the same
contracts, so the layers pick either by device.

Why: a decode step at small batch on a GPU is mostly these steps, not the matrix products. A
profile on an H200 (docs/benchmarks.md section 29) counted ~60 kernels a layer, of which 6 were
products and attention and the rest 1-2 us element-wise kernels (PyTorch's RMSNorm alone is
pow, mean, add, rsqrt, two muls and two casts). Here each step is one kernel.

Each kernel rounds where the PyTorch ops it replaces round (to the model's dtype after the
residual add, after the normalisation and after silu), computing in float32 in between, so the
outputs match them to a rounding step. Tested against those ops under Triton's CPU interpreter
(TRITON_INTERPRET=1); `--cuda-fused-ops` (the default on CUDA) turns them on.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, dim, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: x += residual (rounded to x's dtype, as PyTorch's add), then
    # out = weight * (x / rms(x)), the division's result rounded before the weight as in
    # transformers' RMSNorm.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * normed).to(Out.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in one pass; x is updated in place and
    returned as the new residual (as kernels/cpu.add_rmsnorm). x, residual: [..., dim] with
    contiguous rows."""
    dim = x.shape[-1]
    if x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError("add_rmsnorm needs x and residual of one shape with contiguous rows")
    rows = x.view(-1, dim)
    res = residual.view(-1, dim) if residual is not None else rows
    out = torch.empty_like(rows)
    block = triton.next_power_of_2(dim)
    if rows.shape[0]:
        # A whole row in one program: more warps for wider rows (8 values a thread at most up to 4k).
        _add_rmsnorm_kernel[(rows.shape[0],)](rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0),
                                               dim, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                               num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape), x


@triton.jit
def _qk_norm_rope_kernel(QKV, QW, KW, CosSin, Pos, Q, K, stride_qkv, stride_cs, hq, eps, head_dim,
                         HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    # One program per (token, head among the q heads then the k heads): the head's two halves
    # are normed together, then rotated (rotate-half: x1 cos - x2 sin, x2 cos + x1 sin).
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = head_dim // 2
    offs = tl.arange(0, HALF)
    mask = offs < half
    src = QKV + t * stride_qkv + h * head_dim
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / head_dim + eps)
        if h < hq:
            w1 = tl.load(QW + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(QW + half + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(KW + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(KW + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    pos = tl.load(Pos + t)
    cs = CosSin + pos * stride_cs  # [2, head_dim]: cos then sin, each the table's float32 rounded as PyTorch's
    cos1 = tl.load(cs + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cs + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(cs + head_dim + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(cs + head_dim + half + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    o1 = x1 * cos1 - x2 * sin1
    o2 = x2 * cos2 + x1 * sin2
    if h < hq:
        dst = Q + (t * hq + h) * head_dim
    else:
        dst = K + (t * (tl.num_programs(1) - hq) + (h - hq)) * head_dim
    tl.store(dst + offs, o1.to(dtype), mask=mask)
    tl.store(dst + half + offs, o2.to(dtype), mask=mask)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused projection qkv [T, (Hq + 2 Hkv) * D] (contiguous rows): q [T, Hq, D] and
    k [T, Hkv, D], each head RMS-normed (when both weights are given) then rotated by the
    cos/sin table [max_pos, 2, D] (float32, contiguous) at `positions` [T] (as
    kernels/cpu.qk_norm_rope)."""
    if head_dim % 2 or qkv.stride(-1) != 1 or not cos_sin.is_contiguous() or (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope needs an even head_dim, contiguous rows and both norm weights or none")
    t = qkv.shape[0]
    q = qkv.new_empty((t, num_heads, head_dim))
    k = qkv.new_empty((t, num_kv_heads, head_dim))
    if t:
        w = q_weight if q_weight is not None else cos_sin  # (not read without the norm)
        _qk_norm_rope_kernel[(t, num_heads + num_kv_heads)](
            qkv, w, k_weight if k_weight is not None else w, cos_sin, positions, q, k, qkv.stride(0),
            cos_sin.stride(0), num_heads, eps, head_dim, HAS_NORM=q_weight is not None,
            HALF=triton.next_power_of_2(head_dim // 2))
    return q, k


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_g, stride_o, d, BLOCK: tl.constexpr):
    # One program per (row, block of BLOCK channels): silu(gate) rounded to the dtype (as
    # PyTorch's silu), then times up.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(GateUp + row * stride_g + d + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * u.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused projection gate_up [..., 2 * d] with contiguous rows:
    [..., d] in one pass (as kernels/cpu.silu_mul)."""
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul needs contiguous rows")
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)
    out = gate_up.new_empty((rows.shape[0], d))
    block = min(1024, triton.next_power_of_2(d))
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](rows, out, rows.stride(0), out.stride(0), d,
                                                                BLOCK=block)
    return out.view(*gate_up.shape[:-1], d)


def available(device: torch.device) -> bool:
    """On CUDA (the kernels also run under TRITON_INTERPRET=1 on CPU tensors, for tests)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
