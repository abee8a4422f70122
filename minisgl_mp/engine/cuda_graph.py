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

Speculative decoding's verify steps (each request runs its last token and its draft, up to
K + 1 tokens) replay graphs of their own (`tokens_per_req` = K + 1): each request owns K + 1
rows of the static buffers, those past its tokens padding (pad slot, no keys seen), and the
attention backend turns the per-request query lengths read from the buffers into one-token
queries for its decode kernel, as eager verification does. Any batch whose requests all run
at most K + 1 tokens fits (a short prefill too).

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
        """Metadata for the first `batch_size` requests (`batch_size * inputs.tokens_per_req`
        rows), as views of `inputs`' buffers."""


def padded_token_rows(extend_lens: tuple[int, ...] | list[int], tokens_per_req: int) -> list[int]:
    """Row of each of a batch's tokens in buffers where request i owns rows
    [i * tokens_per_req, (i + 1) * tokens_per_req)."""
    return [i * tokens_per_req + j for i, n in enumerate(extend_lens) for j in range(n)]


@dataclass
class DecodeGraphInputs:
    """Static buffers a graph reads, refilled in place before each replay: per token
    [max_bs * tokens_per_req], per request [max_bs]."""

    input_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    out_loc: torch.Tensor  # int64, KV slot of each new token
    req_rows: torch.Tensor  # int64, page-table row of each request
    seq_lens: torch.Tensor  # int32, prefix + the new tokens; 0 on padding requests
    pad_slot: int
    tokens_per_req: int = 1
    # Verify graphs only (tokens_per_req > 1), int32 per request: which of its rows it runs.
    q_len: torch.Tensor | None = None  # tokens the request runs; 0 on padding requests
    prefix_len: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_bs: int, pad_slot: int, device: torch.device, tokens_per_req: int = 1) -> DecodeGraphInputs:
        if tokens_per_req < 1:
            raise ValueError(f"tokens_per_req must be >= 1, got {tokens_per_req}")

        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        t = max_bs * tokens_per_req
        inputs = cls(zeros(t, torch.int64), zeros(t, torch.int64), zeros(t, torch.int64), zeros(max_bs, torch.int64),
                     zeros(max_bs, torch.int32), pad_slot, tokens_per_req)
        if tokens_per_req > 1:
            inputs.q_len, inputs.prefix_len = zeros(max_bs, torch.int32), zeros(max_bs, torch.int32)
        inputs.out_loc.fill_(pad_slot)
        return inputs

    @property
    def max_bs(self) -> int:
        return self.req_rows.numel()

    def fits(self, layout: BatchLayout) -> bool:
        """Whether every request of `layout` runs no more tokens than a request owns rows."""
        if self.tokens_per_req == 1:
            return layout.mode == ForwardMode.DECODE
        return max(layout.extend_lens, default=0) <= self.tokens_per_req

    def load(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor,
             padded_bs: int) -> torch.Tensor | None:
        """Requests [0, B) take the batch; requests [B, padded_bs) and the rows a request does
        not use are padding. Returns the row of each of the batch's tokens (None when they are
        rows [0, T), as in a decode graph)."""
        b, q = layout.batch_size, self.tokens_per_req
        seq_lens = host_tensor(list(layout.seq_lens), torch.int32, self.seq_lens.device)
        self.req_rows[:b].copy_(layout.req_slots)
        self.seq_lens[:b].copy_(seq_lens)
        if q == 1:
            self.input_ids[:b].copy_(input_ids)
            self.positions[:b].copy_(positions)
            self.out_loc[:b].copy_(layout.out_loc)
            if padded_bs > b:
                for buf in (self.input_ids, self.positions, self.req_rows, self.seq_lens):
                    buf[b:padded_bs].zero_()
                self.out_loc[b:padded_bs].fill_(self.pad_slot)
            return None
        device = self.input_ids.device
        rows = host_tensor(padded_token_rows(layout.extend_lens, q), torch.int64, device)
        t = padded_bs * q
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.out_loc[:t].fill_(self.pad_slot)
        self.input_ids.index_copy_(0, rows, input_ids)
        self.positions.index_copy_(0, rows, positions)
        self.out_loc.index_copy_(0, rows, layout.out_loc)
        self.q_len[:b].copy_(host_tensor(list(layout.extend_lens), torch.int32, device))
        self.prefix_len[:b].copy_(host_tensor(list(layout.prefix_lens), torch.int32, device))
        if padded_bs > b:
            for buf in (self.req_rows, self.seq_lens, self.q_len, self.prefix_len):
                buf[b:padded_bs].zero_()
        return rows


class DecodeGraphRunner:
    """Decode steps (or verify steps, `tokens_per_req` > 1) through captured graphs, one per
    bucket of batch sizes."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pad_slot: int, max_bs: int,
                 device: torch.device, tokens_per_req: int = 1) -> None:
        if not hasattr(backend, "graph_metadata"):
            raise ValueError(f"the {getattr(backend, 'name', type(backend).__name__)} attention backend "
                             "cannot run in a CUDA graph; use --attention-backend triton or --disable-cuda-graph")
        self.model = model
        self.backend = backend
        self.sizes = capture_batch_sizes(max_bs)
        self.inputs = DecodeGraphInputs.allocate(max_bs, pad_slot, device, tokens_per_req)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    @property
    def tokens_per_req(self) -> int:
        return self.inputs.tokens_per_req

    def can_run(self, layout: BatchLayout) -> bool:
        return (bool(self.graphs) and self.inputs.fits(layout)
                and padded_batch_size(layout.batch_size, self.sizes) is not None)

    def forward_static(self, batch_size: int) -> torch.Tensor:
        """The model over the first `batch_size` requests' rows of the static inputs: what a
        graph holds (logits of every row, padding included)."""
        t = batch_size * self.tokens_per_req
        attn = AttentionContext(self.backend, self.backend.graph_metadata(self.inputs, batch_size))
        return self.model(self.inputs.input_ids[:t], self.inputs.positions[:t], attn, None)

    def capture(self, progress: bool = True) -> None:
        """One graph per bucket, largest first (later ones reuse its memory pool; a pool set
        before, another runner's, is shared)."""
        stream = torch.cuda.Stream()
        what = "decode" if self.tokens_per_req == 1 else f"verify ({self.tokens_per_req} tokens a request)"
        for bs in tqdm(sorted(self.sizes, reverse=True), desc=f"capturing CUDA graphs, {what}",
                       disable=not progress):
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
        logger.info("captured CUDA graphs, %s, for batch sizes %s", what, ",".join(map(str, self.sizes)))

    def replay(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of the batch's tokens, in its order, for a batch that `can_run`."""
        padded = padded_batch_size(layout.batch_size, self.sizes)
        if padded is None:
            raise ValueError(f"batch of {layout.batch_size} is past the largest captured size {self.sizes[-1]}")
        rows = self.inputs.load(layout, input_ids, positions, padded)
        self.graphs[padded].replay()
        out = self.outputs[padded]
        return out[: layout.batch_size] if rows is None else out[rows]
