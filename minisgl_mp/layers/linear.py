from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Weights are allocated uninitialised: the loader fills them.

    On the CPU, `prepack()` converts the weight once into oneDNN's blocked layout, which runs
    products of a few rows and up faster than `F.linear` re-packing on every call (measured
    1.3-1.9x for 8-64 rows). For a single row the plain weight streamed by `F.linear` wins
    (a 1024 -> 151936 LM head: 24 vs 32 ms), so both are kept; the plain weight also stays
    the source of truth (tying, reloading, tests read it).
    """

    PACKED_MIN_ROWS = 4

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        self.packed_weight: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Pack the weight for oneDNN; returns whether this build and dtype allow it."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not _onednn_available():
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.numel() >= self.PACKED_MIN_ROWS * self.in_features:
            shape = x.shape
            y = torch.ops.mkldnn._linear_pointwise(
                x.reshape(-1, shape[-1]), self.packed_weight, self.bias, "none", [], ""
            )
            return y.view(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
