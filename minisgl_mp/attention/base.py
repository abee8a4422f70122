"""The attention backend interface.

A backend reads and writes K/V in the paged pool. Once per forward it turns a `BatchLayout`
(which tokens belong to which request, where their KV lives) into backend-specific metadata;
every layer then calls `forward` with that metadata. A GPU backend (Triton, FlashInfer) plugs in
behind the same two calls.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.Enum):
    # EXTEND: every request brings one or more new tokens after its cached prefix (prefill,
    # chunked prefill, prefill over a radix-cache hit). DECODE: exactly one new token each.
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's tokens are. Tokens of the batch are laid out request by request.

    req_slots:   [B] rows of the request table (page table) that hold each request's KV slots
    prefix_lens: per request, tokens whose KV is already in the pool (the prefix)
    extend_lens: per request, new tokens in this forward (1 each for DECODE)
    out_loc:     [T] KV slot each new token writes, T = sum(extend_lens)
    """

    mode: ForwardMode
    req_slots: torch.Tensor
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    out_loc: torch.Tensor

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.out_loc.numel())

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + e for c, e in zip(self.prefix_lens, self.extend_lens))


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, layout: BatchLayout) -> Any:
        """Build the per-forward metadata (index tensors, masks) shared by every layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, metadata: Any
    ) -> torch.Tensor:
        """Store k, v of the new tokens in the pool, then attend.

        q: [T, Hq, D]; k, v: [T, Hkv, D] -> output [T, Hq, D].
        """


@dataclass(frozen=True)
class AttentionContext:
    """What a model's attention layers receive with each forward: the backend and its metadata."""

    backend: AttentionBackend
    metadata: Any

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer_id, self.metadata)
