from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused projection: gate_up [..., 2 * d] -> silu(gate) * up [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
