from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.activation import silu_and_mul
from minisgl_mp.layers.linear import Linear


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), as Llama and Qwen define it."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # Fused gate|up projection: rows [0, I) are gate, [I, 2I) are up.
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.cpu_kernels = False
        self.triton_kernels = False

    def enable_cpu_kernels(self) -> bool:
        """SwiGLU as one C pass (float32 on the CPU): PyTorch's takes three passes over the
        [tokens, 2 * intermediate] projection, a tenth of a long prefill."""
        self.cpu_kernels = self.gate_up_proj.weight.device.type == "cpu" and cpu_kernels.load() is not None
        return self.cpu_kernels

    def enable_triton_kernels(self) -> bool:
        """SwiGLU as one Triton kernel on CUDA (PyTorch's is three)."""
        from minisgl_mp.kernels import triton_ops  # imports triton: only where it is wanted

        self.triton_kernels = triton_ops.available(self.gate_up_proj.weight.device)
        return self.triton_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_kernels and gate_up.dtype == torch.float32:
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        if self.triton_kernels and gate_up.stride(-1) == 1:
            from minisgl_mp.kernels import triton_ops

            return self.down_proj(triton_ops.silu_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))
