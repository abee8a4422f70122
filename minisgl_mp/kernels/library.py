"""Building and loading the CPU kernels (csrc/*.c): compiled together with the system C
compiler (a second or two) into one library in a per-user cache and loaded with ctypes: no
torch headers, no pybind. OpenMP is resolved to the libgomp torch has already loaded, so the
kernels share torch's threads and settings. Anything that goes wrong (no compiler, a failed
build) is logged once and callers fall back to their PyTorch paths.

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
    lib.vnni_gemm_ready.restype = ctypes.c_int
    lib.vnni_gemm_ready.argtypes = []
    lib.vnni_gemm_packed_bytes.restype = i64
    lib.vnni_gemm_packed_bytes.argtypes = [ctypes.c_int, i64, i64]
    for fn in (lib.vnni_gemm_pack_i8, lib.vnni_gemm_pack_q4):
        fn.restype = ctypes.c_int
        fn.argtypes = [vp, i64, i64, vp]
    lib.vnni_gemm.restype = ctypes.c_int
    lib.vnni_gemm.argtypes = [vp, i64, i64, i64, ctypes.c_int, vp, vp, vp, vp, i64, i64]
    for fn in (lib.packed_gemm_unit, lib.packed_gemm_rows, lib.bf16dot_gemm_unit):
        fn.restype = ctypes.c_int
        fn.argtypes = []
    _LIBS[isa] = lib
    return lib


def fused_ok(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return False
    return True

