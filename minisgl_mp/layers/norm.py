from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does, then cast back.

    With `enable_cpu_kernels()` (float32 on the CPU), `forward_with_residual` runs as one C
    pass (add, norm, scale) that writes x + residual into x itself: callers pass an x they
    own (a layer's fresh output), as the models here do. `enable_triton_kernels()` does the
    same on CUDA with one Triton kernel (kernels/triton_ops.py), in any dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.cpu_kernels = False
        self.triton_kernels = False

    def enable_cpu_kernels(self) -> bool:
        self.cpu_kernels = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        return self.cpu_kernels

    def enable_triton_kernels(self) -> bool:
        from minisgl_mp.kernels import triton_ops  # imports triton: only where it is wanted

        self.triton_kernels = triton_ops.available(self.weight.device)
        return self.triton_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds `residual` into `x` first (when given); returns (normed, new residual)."""
        if (self.cpu_kernels and x.dtype == torch.float32 and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):
            return cpu_kernels.add_rmsnorm(x, residual, self.weight, self.eps)
        if self.triton_kernels and x.stride(-1) == 1 and (residual is None or (residual.shape == x.shape
                                                                                and residual.stride(-1) == 1)):
            from minisgl_mp.kernels import triton_ops

            return triton_ops.add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.forward(x), x
