"""Mixture-of-experts feed-forward: many SwiGLU experts, each token through the k its router picked."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_mp.layers.activation import silu_and_mul


class FusedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored as two stacked tensors, computed grouped by expert.

    The (token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous
    block: one gate|up and one down product per expert that has tokens, whatever the batch size
    (the loop runs over experts, never over tokens). A fused grouped-GEMM kernel can replace the
    loop on GPU without touching the routing.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        # gate_up_proj: [E, 2I, H], rows [0, I) gate and [I, 2I) up per expert; down_proj: [E, H, I]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_ids, topk_weights: [T, k] -> sum over k of weight * expert(x): [T, H]."""
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # pair indices, grouped by expert
        token_of_pair = order // k
        # One host sync per layer: the group sizes decide the slices.
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        xs = x.index_select(0, token_of_pair)  # [T * k, H], expert-major
        out = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                h = silu_and_mul(F.linear(xs[rows], self.gate_up_proj[expert]))
                out[rows] = F.linear(h, self.down_proj[expert])
                start += n
        # Back to (token, k) order, then the weighted sum over k: a gather (deterministic, and
        # cheap on the CPU where index_add_ with repeated indices is not).
        pairs = out.index_select(0, torch.argsort(order))
        weighted = pairs.view(*topk_ids.shape, -1) * topk_weights.unsqueeze(-1).to(out.dtype)
        return weighted.sum(dim=1)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={two_i // 2}"
