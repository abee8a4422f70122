from __future__ import annotations

import torch

from minisgl_mp.engine_config import DTYPE_CHOICES

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
