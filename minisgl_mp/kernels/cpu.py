"""The C kernels for the CPU (csrc/*.c), built on first use, and their Python entry points:
paged attention (csrc/paged_attention.c) and its blocked form for long query runs
(csrc/extend_attention.c), the fused norm / rotary steps of a decoder layer
(csrc/fused_ops.c), the small-batch product with float32, 16-bit or int8 weights
(csrc/weight_gemm.c), the register-tiled float32 product over packed weights for decode
batches (csrc/packed_gemm.c), bfloat16 products and prompt attention on AMX tiles where the
CPU has them (csrc/amx_gemm.c, csrc/amx_attention.c), bfloat16 products and prompt attention
on AVX512-BF16's dot products where it has those but no AMX (csrc/bf16dot_gemm.c,
csrc/bf16dot_attention.c), and a probe of the machine's FMA
ceiling for the benchmarks (csrc/fma_peak.c).

The sources are compiled together with the system C compiler (a second or two) into one
library in a per-user cache and loaded with ctypes: no torch headers, no pybind. OpenMP is
resolved to the libgomp torch has already loaded, so the kernels share torch's threads and
settings. Anything that goes wrong (no compiler, a failed build) is logged once and callers
fall back to their PyTorch paths.

The vector ISA follows the build machine's flags (-march=native). MINISGL_MP_CPU_ISA=avx2
builds without AVX-512 and =scalar without any AVX, so one machine can test every path; each
choice is its own cached library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.c"))
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # part of the build's cache key
# NOTE: never -ffast-math here: linking a shared library with it pulls in crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process as soon as the library loads. The
# kernel flushes denormals itself, for its own duration only; its sums are reassociated
# through `omp simd reduction`, which needs no global flag.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared"]
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS.append("-mprefer-vector-width=512")  # gcc stops at 256-bit vectors on x86 by default
# Extra flags per ISA override: -mno-avx512f / -mno-avx also drop every extension built on them.
# noamx is native without AMX (csrc/amx_gemm.c): the other path of bfloat16 weights on AMX CPUs.
ISA_FLAGS = {"native": [], "noamx": ["-mno-amx-tile"], "avx2": ["-mno-avx512f", "-mno-amx-tile"],
             "scalar": ["-mno-avx", "-mno-amx-tile"]}
_LIBS: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    base = os.environ.get("MINISGL_MP_KERNEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minisgl_mp", "kernels")
    return Path(base)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(cc: str, isa: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f"{src.name}\0{src.read_text()}" for src in (*SOURCES, *HEADERS)]
    flags = CFLAGS + ISA_FLAGS[isa]
    key = hashlib.sha256("\0".join([*texts, *flags, version, _cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: concurrent builders race harmlessly
    return target


_DEFAULT_ISA: str | None = None


def default_isa() -> str:
    """MINISGL_MP_CPU_ISA, else native; read once per process (the kernels' wrappers ask on
    every call, a few hundred times a decode step)."""
    global _DEFAULT_ISA
    if _DEFAULT_ISA is None:
        isa = os.environ.get("MINISGL_MP_CPU_ISA", "native")
        if isa not in ISA_FLAGS:
            raise ValueError(f"MINISGL_MP_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
        _DEFAULT_ISA = isa
    return _DEFAULT_ISA


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel library built for `isa` (default: MINISGL_MP_CPU_ISA, else native), or None
    when it cannot be built here (logged once)."""
    isa = isa or default_isa()
    if isa in _LIBS:
        return _LIBS[isa]
    _LIBS[isa] = None
    if os.environ.get("MINISGL_MP_NO_CPU_KERNEL"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found: CPU kernels fall back to PyTorch (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, isa)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable (%s): falling back to PyTorch", e)
        return None
    # Tensors go in as their data_ptr() (c_void_p): the checks are done in Python beforehand.
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16kv):
        fn.restype = ctypes.c_int
        fn.argtypes = [vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float, i64]
    lib.extend_attention_f32.restype = ctypes.c_int
    lib.extend_attention_f32.argtypes = [vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float]
    lib.extend_attention_amx.restype = ctypes.c_int
    lib.extend_attention_amx.argtypes = lib.extend_attention_f32.argtypes
    lib.extend_attention_bf16dot.restype = ctypes.c_int
    lib.extend_attention_bf16dot.argtypes = lib.extend_attention_f32.argtypes
    lib.add_rmsnorm_f32.restype = None
    lib.add_rmsnorm_f32.argtypes = [vp, vp, vp, ctypes.c_float, vp, i64, i64]
    lib.qk_norm_rope_f32.restype = None
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [vp, i64, i64, i64, vp]
    lib.qk_norm_rope_f32.argtypes = [vp, i64, i64, i64, i64, i64, vp, vp, ctypes.c_float, vp, vp, vp, vp]
    lib.fma_peak_gflops.restype = ctypes.c_double
    lib.fma_peak_gflops.argtypes = [i64]
    lib.kv_store_f32.restype = None
    lib.kv_store_f32.argtypes = [vp, i64, vp, i64, vp, i64, i64, vp, vp, ctypes.c_int]
    lib.weight_gemm.restype = ctypes.c_int
    lib.weight_gemm.argtypes = [vp, i64, i64, vp, ctypes.c_int, vp, vp, vp, i64, i64]
    lib.weight_gemm_isa.restype = ctypes.c_int
    lib.weight_gemm_isa.argtypes = []
    lib.packed_gemm_pack.restype = None
    lib.packed_gemm_pack.argtypes = [vp, i64, i64, vp]
    lib.packed_gemm_f32.restype = None
    lib.packed_gemm_f32.argtypes = [vp, i64, i64, i64, vp, i64, vp, vp, i64]
    lib.amx_gemm_ready.restype = ctypes.c_int
    lib.amx_gemm_ready.argtypes = []
    lib.amx_gemm_pack.restype = ctypes.c_int
    lib.amx_gemm_pack.argtypes = [vp, i64, i64, vp]
    lib.amx_gemm_bf16.restype = ctypes.c_int
    lib.amx_gemm_bf16.argtypes = [vp, i64, i64, i64, vp, i64, vp, vp, i64]
    lib.bf16dot_gemm_ready.restype = ctypes.c_int
    lib.bf16dot_gemm_ready.argtypes = []
    lib.bf16dot_gemm_pack.restype = ctypes.c_int
    lib.bf16dot_gemm_pack.argtypes = [vp, i64, i64, vp]
    lib.bf16dot_gemm_bf16.restype = ctypes.c_int
    lib.bf16dot_gemm_bf16.argtypes = lib.amx_gemm_bf16.argtypes
    for fn in (lib.packed_gemm_unit, lib.packed_gemm_rows, lib.bf16dot_gemm_unit):
        fn.restype = ctypes.c_int
        fn.argtypes = []
    _LIBS[isa] = lib
    return lib


# Pool dtypes the kernel reads K/V in (queries and outputs are always float32).
KV_DTYPES = (torch.float32, torch.bfloat16)


def default_key_splits(batch: int) -> int:
    """The most key ranges `paged_attention` splits each of `batch` requests into: more than one
    only when requests alone cannot keep every thread busy with two work items (the kernel also
    keeps each range at 64 keys or more)."""
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
    on the CPU. key_splits: the most key ranges a request is split into over threads (default:
    enough to give every thread two work items). `isa` picks a build (tests).
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


def _fused_ok(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return False
    return True


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


# Stored weight dtypes the product kernel widens, and its format codes (csrc/weight_gemm.c).
WEIGHT_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def weight_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K]^T -> [M, N] float32, weight float32, float16, bfloat16
    or int8 (then times `scale` [N], its per-output-channel float32 scale), plus `bias` [N]
    float32. All contiguous, on the CPU. Bound by the weight bytes for small M."""
    return StoredWeight(weight, scale, bias, isa).matmul(x)


class StoredWeight:
    """A weight in one of WEIGHT_FORMATS (with its int8 scale and its bias) checked once, for
    the product kernel of csrc/weight_gemm.c: `Linear` calls it a hundred times a decode step,
    so each call checks only x."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        self._lib = lib = load(isa)
        if lib is None:
            raise RuntimeError("the CPU product kernel is not available")
        fmt = WEIGHT_FORMATS.get(weight.dtype)
        if fmt is None or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
            raise ValueError(f"weight must be a contiguous 2-D CPU tensor in {list(WEIGHT_FORMATS)}, got {weight.dtype}")
        n = weight.shape[0]
        if (scale is not None) != (weight.dtype == torch.int8):
            raise ValueError("scale is given exactly when the weight is int8")
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and (t.shape != (n,) or not _fused_ok(t)):
                raise ValueError(f"{name} must be contiguous float32 [{n}]")
        self.weight, self.scale, self.bias, self.fmt = weight, scale, bias, fmt
        self.out_features, self.in_features = weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32, contiguous, on the CPU -> [M, N] float32."""
        n, k = self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or not _fused_ok(x):
            raise ValueError(f"x must be contiguous float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
        y = x.new_empty((x.shape[0], n))
        scale, bias = self.scale, self.bias
        self._lib.weight_gemm(x.data_ptr(), x.shape[0], k, self.weight.data_ptr(), self.fmt,
                              None if scale is None else scale.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), n, n)
        return y


class PackedWeight:
    """A float32 weight [N, K] packed into the column panels of csrc/packed_gemm.c, for the
    library of one ISA (the layout follows its vector width)."""

    PANEL = 16

    def __init__(self, weight: torch.Tensor, isa: str | None = None) -> None:
        self.isa = isa or default_isa()
        self._lib = lib = load(self.isa)
        if lib is None:
            raise RuntimeError("the CPU product kernel is not available")
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"weight must be a 2-D float32 CPU tensor, got {weight.dtype} {tuple(weight.shape)}")
        weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        padded = -(-self.out_features // self.PANEL) * self.PANEL
        self.panels = torch.empty(padded * self.in_features, dtype=torch.float32)
        lib.packed_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32, plus `bias` [N]
        float32."""
        n, k = self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        if bias is not None and (bias.shape != (n,) or not _fused_ok(bias)):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        y = x.new_empty((x.shape[0], n))
        self._lib.packed_gemm_f32(x.data_ptr(), x.shape[0], k, x.stride(0), self.panels.data_ptr(), n,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        return y


def amx_ready(isa: str | None = None) -> bool:
    """Whether bfloat16 products can run on AMX here: a build with it (an AMX CPU, `native`)
    and the kernel's permission to use the tile registers."""
    lib = load(isa)
    return lib is not None and bool(lib.amx_gemm_ready())


def bf16dot_ready(isa: str | None = None) -> bool:
    """Whether bfloat16 products can run on AVX512-BF16's dot products here (a build with it:
    `native` on such a CPU)."""
    lib = load(isa)
    return lib is not None and bool(lib.bf16dot_gemm_ready())


class _Bf16Packed:
    """A bfloat16 weight [N, K] packed once for one of the kernels that round x to bfloat16
    and multiply on 16-bit units, float32 accumulation and output: y = x W^T (+ bias)."""

    KIND = ""
    REQUIRES = ""

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        raise NotImplementedError

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        raise NotImplementedError

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
                and cls._shape_ok(*weight.shape))

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None) -> None:
        self._lib = lib = load(isa)
        if lib is None or not self._ready(lib):
            raise RuntimeError(f"{self.KIND} products are not available on this CPU or build")
        if not self.fits(weight):
            raise ValueError(f"weight must be a 2-D bfloat16 CPU tensor with {self.REQUIRES}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and (bias.shape != (self.out_features,) or not _fused_ok(bias)):
            raise ValueError(f"bias must be contiguous float32 [{self.out_features}]")
        self.bias = bias
        self.packed = self._pack(lib, weight.contiguous())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gemm(self, *args: int | None) -> int:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32."""
        n, k = self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        y = x.new_empty((x.shape[0], n))
        if x.shape[0] == 0:
            return y
        rc = self._gemm(x.data_ptr(), x.shape[0], k, x.stride(0), self.packed.data_ptr(), n,
                        None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), n)
        if rc != 0:
            raise MemoryError(f"the {self.KIND} product could not allocate its bfloat16 copy of x")
        return y


class AmxWeight(_Bf16Packed):
    """A bfloat16 weight [N, K] (N and K multiples of 32) packed into AMX tiles for
    csrc/amx_gemm.c: y = x W^T with x rounded to bfloat16, float32 accumulation and output."""

    KIND = "AMX"
    REQUIRES = "both sides multiples of 32"
    BLOCK = 32

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        return n % cls.BLOCK == 0 and k % cls.BLOCK == 0

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        return bool(lib.amx_gemm_ready())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        tiles = torch.empty(weight.numel(), dtype=torch.bfloat16)
        lib.amx_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, tiles.data_ptr())
        return tiles

    def _gemm(self, *args: int | None) -> int:
        return self._lib.amx_gemm_bf16(*args)


class Bf16DotWeight(_Bf16Packed):
    """A bfloat16 weight [N, K] (K even) packed into the pair panels of csrc/bf16dot_gemm.c,
    for CPUs with AVX512-BF16 and no AMX: y = x W^T with x rounded to bfloat16, float32
    accumulation and output (the numerics of AmxWeight)."""

    KIND = "AVX512-BF16"
    REQUIRES = "an even number of inputs"
    PANEL = 16

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        return n > 0 and k > 0 and k % 2 == 0

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        return bool(lib.bf16dot_gemm_ready())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        padded = -(-self.out_features // self.PANEL) * self.PANEL
        panels = torch.empty(padded * self.in_features, dtype=torch.bfloat16)
        lib.bf16dot_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, panels.data_ptr())
        return panels

    def _gemm(self, *args: int | None) -> int:
        return self._lib.bf16dot_gemm_bf16(*args)


def packed_gemm_tile(isa: str | None = None) -> tuple[int, int] | None:
    """(channels per unit, rows per tile) of the packed product in this build (None: no kernels)."""
    lib = load(isa)
    return None if lib is None else (int(lib.packed_gemm_unit()), int(lib.packed_gemm_rows()))


def fma_peak_gflops(iters: int = 20_000_000, reps: int = 3) -> float | None:
    """The float32 FMA ceiling of this machine over torch's threads (csrc/fma_peak.c), GFLOP/s:
    the best of `reps` runs of `iters` rounds of a register-only FMA loop a thread (~0.1 s
    each). None without the kernels."""
    lib = load()
    return None if lib is None else max(lib.fma_peak_gflops(iters) for _ in range(reps))


def kernel_isa(isa: str | None = None) -> int | None:
    """512, 256 or 0: the vector width the product kernel was built with (None: no kernels)."""
    lib = load(isa)
    return None if lib is None else int(lib.weight_gemm_isa())
