"""Attention backends by name (`--attention-backend`, SGLang's flag).

| name       | where                  | what                                                        |
| ---------- | ---------------------- | ----------------------------------------------------------- |
| cpu        | CPU, float32 model     | the C paged kernel; long extends through sdpa (default CPU) |
| sdpa       | anywhere               | PyTorch scaled_dot_product_attention, 4-D inputs            |
| triton     | CUDA (CPU: interpreter)| Triton paged decode / extend kernels (CUDA default w/o FI)  |
| flashinfer | CUDA, package present  | FlashInfer paged prefill / decode wrappers (CUDA default)   |

`auto` picks cpu on the CPU (sdpa when the kernel cannot run: no C compiler, a non-float32
model or a float16 pool), flashinfer on CUDA when it imports, else triton.
"""

from __future__ import annotations

import importlib.util

import torch

from minisgl_mp.attention.base import AttentionBackend
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable

BACKENDS = ("cpu", "sdpa", "triton", "flashinfer")


def is_available(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype = torch.float32) -> bool:
    if name == "cpu":
        from minisgl_mp.kernels import cpu as cpu_kernel

        return (device.type == "cpu" and dtype == torch.float32 and kv_dtype in cpu_kernel.KV_DTYPES
                and cpu_kernel.load() is not None)
    if name == "sdpa":
        return True
    if name == "triton":
        from minisgl_mp.attention.triton_backend import is_available as triton_ok

        return triton_ok(device)
    if name == "flashinfer":
        return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None
    return False


def resolve_name(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The backend `name` stands for here (`auto` resolved); a ValueError when it cannot run."""
    if name == "auto":
        if device.type == "cpu":
            return "cpu" if is_available("cpu", device, dtype, kv_dtype) else "sdpa"
        return "flashinfer" if is_available("flashinfer", device) else "triton"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose auto or one of {BACKENDS}")
    if not is_available(name, device, dtype, kv_dtype):
        why = {
            "cpu": "a CPU device, a float32 model, float32 or bfloat16 KV and a C compiler",
            "triton": "the triton package and a GPU (on the CPU only under TRITON_INTERPRET=1)",
            "flashinfer": "a CUDA device and the flashinfer package",
        }[name]
        raise ValueError(f"--attention-backend {name} needs {why}; on {device} use sdpa or auto")
    return name


def create_backend(name: str, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype) -> AttentionBackend:
    """The backend called `name` (resolved: not `auto`) for this pool and head shape."""
    if name == "cpu":
        from minisgl_mp.attention.cpu import CpuBackend

        return CpuBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype)
    if name == "sdpa":
        from minisgl_mp.attention.sdpa import SdpaBackend

        return SdpaBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype)
    if name == "triton":
        from minisgl_mp.attention.triton_backend import TritonBackend

        return TritonBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype)
    if name == "flashinfer":
        from minisgl_mp.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype)
    raise ValueError(f"unknown attention backend {name!r}: choose one of {BACKENDS}")
