from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.layers.activation import silu_and_mul
from minisgl_mp.layers.linear import Linear


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), as Llama and Qwen define it."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # Fused gate|up projection: rows [0, I) are gate, [I, 2I) are up.
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
