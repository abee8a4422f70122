"""A GGUF file's 4-bit tensors as our int4 blocks (kernels/int4.py), keeping the file's values.

Q4_1 is our layout byte for byte (float16 d, float16 m, 16 bytes of nibbles: element d * q + m).
Q4_0 (float16 d, the same 16 bytes: element d * (q - 8)) is it with m = -8 d: in float16 that
product is exact (a power-of-two multiple of d), and d * q + m then equals d * (q - 8) in
float32 too (d * q and d * (q - 8) both fit float32's mantissa), so the values are the file's.
Blocks run along a row (an output channel), so llama.cpp's q/k row permutation is undone on
whole rows, as `models/gguf.py` does on dequantized tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minisgl_mp.kernels import int4

_Q4_0_BYTES = 18  # float16 d, 16 bytes of nibbles


def int4_blocks(tensor: Any, unpermute: Any = None) -> torch.Tensor | None:
    """The gguf reader's 2-D `tensor` as int4 blocks [rows, cols / 32 * 20] (uint8), or None when
    it is not held as Q4_0 / Q4_1. `unpermute`: applied to the rows (gguf.py's `_unpermute`)."""
    from gguf import GGMLQuantizationType

    if len(tensor.shape) != 2 or tensor.tensor_type not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        return None
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    data = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // int4.GROUP, -1)
    if tensor.tensor_type == GGMLQuantizationType.Q4_0:
        if data.shape[-1] != _Q4_0_BYTES:
            raise ValueError(f"{tensor.name}: Q4_0 blocks of {data.shape[-1]} bytes")
        d = data[..., :2].copy().view(np.float16)
        with np.errstate(over="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m).all():
            raise ValueError(f"{tensor.name}: a Q4_0 scale too large for its float16 minimum (-8 d)")
        data = np.concatenate([d.view(np.uint8), m.view(np.uint8), data[..., 2:]], axis=-1)
    elif data.shape[-1] != int4.BLOCK_BYTES:
        raise ValueError(f"{tensor.name}: Q4_1 blocks of {data.shape[-1]} bytes")
    data = data.reshape(rows, cols // int4.GROUP * int4.BLOCK_BYTES)
    if unpermute is not None:
        data = unpermute(data)
    return torch.from_numpy(np.array(data, order="C"))  # a copy: the reader maps the file read-only
