"""CUDA graphs for decode steps (`--cuda-graph-max-bs`, `--disable-cuda-graph`).

A decode step launches about a thousand small kernels; replaying a captured graph launches
them as one. A graph replays fixed shapes at fixed addresses, so:
- batch sizes are bucketed (`capture_batch_sizes`): a batch of B decodes runs in the graph of
  the smallest captured size >= B, its extra rows padding;
- inputs live in static buffers (`DecodeGraphInputs`), written in place before each replay;
  padding rows read token 0 at position 0, write their K/V to the pool's pad slot and attend
  over nothing (sequence length 0), so they touch no request's state;
- the attention backend builds its per-step metadata as views of those buffers
  (`graph_metadata`), so replaying needs no new tensors.

The bucketing and the buffers are plain code, tested on the CPU; `capture` and `replay` run
only on CUDA (launch/gpu_check.py exercises them).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tqdm import tqdm

from minisgl_mp.attention.base import AttentionBackend, AttentionContext, BatchLayout, ForwardMode
from minisgl_mp.utils.device import host_tensor

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """SGLang's buckets: 1, 2, 4, 8, then every 8 up to 256 and every 16 past it, up to max_bs
    (always included). Padding wastes at most 7 rows (15 past 256) of a decode step."""
    if max_bs < 1:
        raise ValueError(f"cuda graph max batch size must be >= 1, got {max_bs}")
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_bs + 1, 16))
    return tuple(sorted({s for s in sizes if s < max_bs} | {max_bs}))


def padded_batch_size(batch_size: int, sizes: tuple[int, ...]) -> int | None:
    """The captured size a batch of `batch_size` replays in; None when it is larger than all."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class GraphAttention(Protocol):
    """What an attention backend offers to run inside a captured decode graph."""

    def graph_metadata(self, inputs: DecodeGraphInputs, batch_size: int) -> Any:
        """Decode metadata for the first `batch_size` rows, as views of `inputs`' buffers."""


@dataclass
class DecodeGraphInputs:
    """Static [max_bs] buffers a graph reads, refilled in place before each replay."""

    input_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    out_loc: torch.Tensor  # int64, KV slot of each new token
    req_rows: torch.Tensor  # int64, page-table row of each request
    seq_lens: torch.Tensor  # int32, prefix + the new token; 0 on padding rows
    pad_slot: int

    @classmethod
    def allocate(cls, max_bs: int, pad_slot: int, device: torch.device) -> DecodeGraphInputs:
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_bs, dtype=dtype, device=device)

        inputs = cls(zeros(torch.int64), zeros(torch.int64), zeros(torch.int64), zeros(torch.int64),
                     zeros(torch.int32), pad_slot)
        inputs.out_loc.fill_(pad_slot)
        return inputs

    @property
    def max_bs(self) -> int:
        return self.input_ids.numel()

    def load(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor, padded_bs: int) -> None:
        """Rows [0, B) take the batch; rows [B, padded_bs) are padding."""
        b = layout.batch_size
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.out_loc[:b].copy_(layout.out_loc)
        self.req_rows[:b].copy_(layout.req_slots)
        self.seq_lens[:b].copy_(host_tensor(list(layout.seq_lens), torch.int32, self.seq_lens.device))
        if padded_bs > b:
            for buf in (self.input_ids, self.positions, self.req_rows, self.seq_lens):
                buf[b:padded_bs].zero_()
            self.out_loc[b:padded_bs].fill_(self.pad_slot)


class DecodeGraphRunner:
    """Decode steps through captured graphs, one per bucket of batch sizes."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pad_slot: int, max_bs: int,
                 device: torch.device) -> None:
        if not hasattr(backend, "graph_metadata"):
            raise ValueError(f"the {getattr(backend, 'name', type(backend).__name__)} attention backend "
                             "cannot run in a CUDA graph; use --attention-backend triton or --disable-cuda-graph")
        self.model = model
        self.backend = backend
        self.sizes = capture_batch_sizes(max_bs)
        self.inputs = DecodeGraphInputs.allocate(max_bs, pad_slot, device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    def can_run(self, layout: BatchLayout) -> bool:
        return (layout.mode == ForwardMode.DECODE and bool(self.graphs)
                and padded_batch_size(layout.batch_size, self.sizes) is not None)

    def forward_static(self, batch_size: int) -> torch.Tensor:
        """The model over the first `batch_size` rows of the static inputs: what a graph holds."""
        attn = AttentionContext(self.backend, self.backend.graph_metadata(self.inputs, batch_size))
        return self.model(self.inputs.input_ids[:batch_size], self.inputs.positions[:batch_size], attn, None)

    def capture(self, progress: bool = True) -> None:
        """One graph per bucket, largest first (later ones reuse its memory pool)."""
        stream = torch.cuda.Stream()
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs", disable=not progress):
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning, lazy allocations
                    self.forward_static(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[bs] = self.forward_static(bs)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", ",".join(map(str, self.sizes)))

    def replay(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch that `can_run`."""
        padded = padded_batch_size(layout.batch_size, self.sizes)
        if padded is None:
            raise ValueError(f"batch of {layout.batch_size} is past the largest captured size {self.sizes[-1]}")
        self.inputs.load(layout, input_ids, positions, padded)
        self.graphs[padded].replay()
        return self.outputs[padded][: layout.batch_size]
