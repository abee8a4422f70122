from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_mp.kernels import int4


class VocabEmbedding(nn.Module):
    """Rows of the embedding table. After `store_weight()` the table may be kept in a smaller
    format (see `Linear.store_weight`, often the very same tensor when the LM head is tied):
    the looked-up rows are widened back to the model's dtype."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.weight_scale: torch.Tensor | None = None
        self.dim = dim
        self.out_dtype = self.weight.dtype

    def store_weight(self, weight: nn.Parameter, scale: torch.Tensor | None = None) -> None:
        """weight: [vocab, dim] (int4 blocks: [vocab, dim / 32 * 20]); scale: [vocab] float32 for
        int8 (one per row)."""
        vocab, dim = self.weight.shape[0], self.dim
        shape = (vocab, int4.row_bytes(dim) if weight.dtype == int4.STORAGE_DTYPE else dim)
        if tuple(weight.shape) != shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != {shape}")
        if (scale is not None) != (weight.dtype == torch.int8):
            raise ValueError("an int8 weight needs its per-row scale, and only it")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.weight_scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        if rows.dtype == int4.STORAGE_DTYPE:
            rows = int4.dequantize(rows)
        if rows.dtype != self.out_dtype:
            rows = rows.to(self.out_dtype)
        if self.weight_scale is not None:
            rows = rows * self.weight_scale[input_ids].unsqueeze(-1)
        return rows
