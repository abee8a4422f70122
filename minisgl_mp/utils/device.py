from __future__ import annotations

import torch

from minisgl_mp.engine_config import DTYPE_CHOICES
from minisgl_mp.kernels import int4

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | None) -> torch.device:
    """None picks CUDA when there is a GPU, else the CPU; a given name is checked."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto` is float32 on the CPU (no fast bfloat16 matrix units on common CPUs: a 2048^2
    bfloat16 product ran 500x slower than float32 on the development machine) and the
    checkpoint's half-precision dtype on a GPU (bfloat16 when the checkpoint is float32)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {DTYPE_CHOICES}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = _DTYPES.get(str(checkpoint_dtype or "").replace("torch.", ""))
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def resolve_weight_dtypes(dtype: str, quantization: str | None, device: torch.device,
                          checkpoint_dtype: str | None) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the model computes in, the dtype its linear and embedding weights are stored
    in). On a GPU both are `dtype` (16-bit arithmetic is native there). On the CPU the model
    computes in float32 and only the weights shrink: float16 / bfloat16 as asked, int8 with
    --quantization int8 (a 16-bit matrix product through PyTorch crawls without 16-bit units),
    int4 blocks (kernels/int4.py: uint8 bytes) with --quantization int4."""
    if device.type != "cpu":
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} is implemented for the CPU only")
        compute = resolve_dtype(dtype, device, checkpoint_dtype)
        return compute, compute
    if quantization == "int8":
        return torch.float32, torch.int8
    if quantization == "int4":
        return torch.float32, int4.STORAGE_DTYPE
    return torch.float32, resolve_dtype(dtype, device, checkpoint_dtype)


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device` without waiting for the device: a plain `torch.tensor(values,
    device="cuda")` copies from pageable memory and synchronises the stream, which would wait
    for the forward that overlap scheduling left running. Pinned staging lets the copy queue
    behind it (PyTorch's pinned allocator keeps the buffer until the copy is done)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def fill_at(t: torch.Tensor, index: tuple[torch.Tensor, ...], value: bool | float) -> None:
    """`t[index] = value` without waiting for the device: assigning a Python scalar through
    indexing copies it to the device from pageable memory, which synchronises the stream (as
    `host_tensor` explains). Here the value is made on the device by a fill kernel."""
    t.index_put_(index, torch.full((), value, dtype=t.dtype, device=t.device))
