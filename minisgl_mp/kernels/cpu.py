"""The C kernels for the CPU (csrc/*.c), built on first use, and their Python entry points:
paged attention (csrc/paged_attention.c) and its blocked form for long query runs
(csrc/extend_attention.c), the fused norm / rotary steps of a decoder layer
(csrc/fused_ops.c), the product with float32, 16-bit, int8 or int4 weights
(csrc/weight_gemm.c), the register-tiled float32 product over packed weights for decode
batches (csrc/packed_gemm.c), bfloat16 products and prompt attention on AMX tiles where the
CPU has them (csrc/amx_gemm.c, csrc/amx_attention.c), bfloat16 products and prompt attention
on AVX512-BF16's dot products where it has those but no AMX (csrc/bf16dot_gemm.c,
csrc/bf16dot_attention.c), int8 and int4 products on AVX512-VNNI's integer dot products
(csrc/vnni_gemm.c), and a probe of the machine's FMA
ceiling for the benchmarks (csrc/fma_peak.c).

Building and loading the library: kernels/library.py (re-exported here); the weights of the
products, checked and laid out once: kernels/weights.py (re-exported too).
"""

from __future__ import annotations

import torch

# Re-exported: callers reach the build and the weight products through this module.
from minisgl_mp.kernels.library import CFLAGS, ISA_FLAGS, default_isa, fused_ok as _fused_ok, load  # noqa: F401
from minisgl_mp.kernels.weights import (  # noqa: F401
    WEIGHT_FORMATS, AmxWeight, Bf16DotWeight, PackedWeight, StoredWeight, VnniWeight, amx_ready, bf16dot_ready,
    kernel_isa, packed_gemm_tile, vnni_ready, weight_gemm)

# Pool dtypes the kernel reads K/V in (queries and outputs are always float32).
KV_DTYPES = (torch.float32, torch.bfloat16)


def default_key_splits(batch: int) -> int:
    """The most runs of key blocks `paged_attention` splits each of `batch` requests into over
    threads: more than one only when requests alone cannot keep every thread busy with two work
    items (the kernel gives each run one 128-key block or more). Splitting changes where a
    request's block partials are merged, never the result."""
    key_splits = 1
    while batch * key_splits < 2 * torch.get_num_threads():
        key_splits *= 2
    return key_splits


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor,
                    q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor, out: torch.Tensor,
                    scale: float, key_splits: int | None = None, isa: str | None = None) -> None:
    """out[rows of each request] = causal attention of its query rows over its paged KV.

    q, out: [T, Hq, D] float32; k, v: [S, Hkv, D] (one layer), float32 or bfloat16 (widened
    on load); kv_index: [B, stride] int64; q_start, q_len, kv_len: [B] int64. All contiguous,
    on the CPU. key_splits: the most runs of 128-key blocks a request is split into over threads
    (default: enough to give every thread two work items); the result is the same bit for bit
    for any value, and each query row's is what that row alone would give. `isa` picks a build
    (tests).
    """
    lib = load(isa)
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != k.dtype or t.dtype not in KV_DTYPES or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 or bfloat16 CPU tensor (k and v alike)")
    for name, t in (("kv_index", kv_index), ("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    batch = q_start.numel()
    if key_splits is None:
        key_splits = default_key_splits(batch)
    fn = lib.paged_attention_f32 if k.dtype == torch.float32 else lib.paged_attention_bf16kv
    rc = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_index.data_ptr(), kv_index.shape[1],
        q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), out.data_ptr(),
        batch, hq, hkv, d, scale, key_splits)
    if rc != 0:
        raise MemoryError("the CPU attention kernel could not allocate its scratch space")


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor,
                     q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor, out: torch.Tensor,
                     scale: float, isa: str | None = None, amx: bool = False, dot: bool = False) -> None:
    """`paged_attention` for long query runs (prefill chunks, extends over a cached prefix):
    csrc/extend_attention.c blocks the query rows against tiles of keys. Same arguments, with
    k and v float32 only and a head dim that is a multiple of 32; `isa` picks a build (tests).
    `amx`: csrc/amx_attention.c instead, both products on AMX tiles in bfloat16 (float32
    softmax and accumulation), head dim at most 256 (`amx_ready()` says where it runs).
    `dot`: csrc/bf16dot_attention.c, the same numerics on AVX512-BF16's dot products
    (`bf16dot_ready()` says where it runs)."""
    lib = load(isa)
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    for name, t in (("q", q), ("out", out), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    for name, t in (("kv_index", kv_index), ("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[1]
    if d % 32 or hq % hkv:
        raise ValueError(f"extend_attention needs a head dim that is a multiple of 32 and whole query groups, "
                         f"got head_dim {d}, {hq} / {hkv} heads")
    fn = lib.extend_attention_amx if amx else lib.extend_attention_bf16dot if dot else lib.extend_attention_f32
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_index.data_ptr(), kv_index.shape[1], q_start.data_ptr(),
            q_len.data_ptr(), kv_len.data_ptr(), out.data_ptr(), q_start.numel(), hq, hkv, d, scale)
    if rc == -2 and dot:
        raise RuntimeError(f"AVX512-BF16 attention is not available here (AVX512-BF16: "
                           f"{bool(lib.bf16dot_gemm_ready())}, head_dim {d})")
    if rc == -2:
        raise RuntimeError(f"AMX attention is not available here (AMX: {bool(lib.amx_gemm_ready())}, head_dim {d})")
    if rc != 0:
        raise MemoryError("the CPU extend-attention kernel could not allocate its scratch space")


def kv_rows(t: torch.Tensor, tokens: int, heads: int, head_dim: int) -> int | None:
    """The row stride (in floats) of a float32 CPU [tokens, heads, head_dim] tensor whose
    tokens' rows are each contiguous, as `kv_store` takes them; None when it is not one."""
    if (t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (tokens, heads, head_dim)
            or t.stride(2) != 1 or t.stride(1) != head_dim):
        return None
    return t.stride(0)


def kv_store(k: torch.Tensor, k_stride: int, v: torch.Tensor, v_stride: int, loc: torch.Tensor,
             k_pool: int, v_pool: int, row: int, bf16: bool) -> None:
    """Scatter new K and V rows (float32, `row` floats a token, rows `k_stride` / `v_stride`
    apart: see `kv_rows`) into the pool rows at `loc` (int64, contiguous) of one layer, whose
    K and V start at the addresses `k_pool` / `v_pool`; float32, or bfloat16 when `bf16`
    (rounded to nearest even). The caller checks the shapes and the slots (KVPool.store)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    lib.kv_store_f32(k.data_ptr(), k_stride, v.data_ptr(), v_stride, loc.data_ptr(), loc.numel(), row,
                     k_pool, v_pool, 1 if bf16 else 0)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in one pass; x is updated in place and
    returned as the new residual. x, residual: [..., dim] float32 contiguous CPU."""
    lib = load()
    if lib is None or not _fused_ok(x, weight, *(() if residual is None else (residual,))):
        raise ValueError("add_rmsnorm needs the kernels and contiguous float32 CPU tensors")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    dim = x.shape[-1]
    out = torch.empty_like(x)
    lib.add_rmsnorm_f32(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        eps, out.data_ptr(), x.numel() // dim, dim)
    return out, x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused projection gate_up [..., 2 * d] (float32 CPU, rows
    contiguous): [..., d] in one pass."""
    lib = load()
    if lib is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.stride(-1) != 1:
        raise ValueError("silu_mul needs the kernels and a float32 CPU tensor with contiguous rows")
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)  # a view for any tensor whose rows are evenly strided
    out = gate_up.new_empty((*gate_up.shape[:-1], d))
    lib.silu_mul_f32(rows.data_ptr(), rows.shape[0], d, rows.stride(0), out.data_ptr())
    return out


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused projection qkv [T, (Hq + 2 Hkv) * D]: q [T, Hq, D] and k [T, Hkv, D],
    contiguous, each head RMS-normed (when its weight is given) then rotated by the cos/sin
    table [max_pos, 2, D] at `positions` [T] (int64)."""
    lib = load()
    weights = tuple(w for w in (q_weight, k_weight) if w is not None)
    if lib is None or not _fused_ok(qkv, cos_sin, *weights) or head_dim % 2 or head_dim > 1024:
        raise ValueError("qk_norm_rope needs the kernels, contiguous float32 CPU tensors and an even head_dim <= 1024")
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.device.type != "cpu":
        raise ValueError("positions must be a contiguous int64 CPU tensor")
    t = qkv.shape[0]
    q = qkv.new_empty((t, num_heads, head_dim))
    k = qkv.new_empty((t, num_kv_heads, head_dim))
    lib.qk_norm_rope_f32(qkv.data_ptr(), t, qkv.shape[1], num_heads, num_kv_heads, head_dim,
                         None if q_weight is None else q_weight.data_ptr(),
                         None if k_weight is None else k_weight.data_ptr(), eps, cos_sin.data_ptr(),
                         positions.data_ptr(), q.data_ptr(), k.data_ptr())
    return q, k


def fma_peak_gflops(iters: int = 20_000_000, reps: int = 3) -> float | None:
    """The float32 FMA ceiling of this machine over torch's threads (csrc/fma_peak.c), GFLOP/s:
    the best of `reps` runs of `iters` rounds of a register-only FMA loop a thread (~0.1 s
    each). None without the kernels."""
    lib = load()
    return None if lib is None else max(lib.fma_peak_gflops(iters) for _ in range(reps))
