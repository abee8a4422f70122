"""Triton paged attention (`--attention-backend triton`; the CUDA default without FlashInfer).

`prepare` turns the batch layout into a few index tensors on the device, once per forward;
every layer then launches the kernels (kernels/triton_attention.py), which read K/V through the
page table. Decodes (and with speculative decoding the K + 1 rows of a verification) go to the
decode kernel, a one-token query per row that reads each K/V block once per KV head for all
its query heads, and whose rows do not depend on the batch; longer runs (prompts, chunks) go
to the extend kernel. A batch with both launches both, each on its own rows.

On the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1): that is for tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl_mp.attention.base import AttentionBackend, BatchLayout, ForwardMode
from minisgl_mp.attention.sdpa import token_starts
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.utils.device import host_tensor

if TYPE_CHECKING:
    from minisgl_mp.engine.cuda_graph import DecodeGraphInputs


@dataclass(frozen=True)
class QueryRun:
    """One-token queries for the decode kernel, one entry per query (int32/int64 on the device)."""

    tokens: torch.Tensor  # [N] row of q and out
    rows: torch.Tensor  # [N] page-table row
    seq_lens: torch.Tensor  # [N] keys the query sees: its position + 1; 0 on graph padding
    grid_splits: int  # the kernel's split dimension, >= every query's split_count


@dataclass(frozen=True)
class ExtendRun:
    """Requests for the extend kernel, one entry per request."""

    rows: torch.Tensor  # [B] page-table rows
    q_start: torch.Tensor  # [B] first token row in the batch
    q_len: torch.Tensor  # [B]
    prefix_len: torch.Tensor  # [B]
    max_q_len: int  # sizes the grid (a host value, so no sync)


@dataclass(frozen=True)
class TritonMetadata:
    out_loc: torch.Tensor  # [T]
    queries: QueryRun | None
    extend: ExtendRun | None


def is_available(device: torch.device) -> bool:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | None = None, max_query: int = 1) -> None:
        if not is_available(pool.k.device):
            raise ValueError("the triton attention backend needs the triton package and a GPU "
                             "(on the CPU only under TRITON_INTERPRET=1, for tests)")
        from minisgl_mp.kernels import triton_attention  # imports triton

        self.kernels = triton_attention
        self.pool = pool
        self.req_table = req_table
        self.dtype = dtype or pool.k.dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Runs of up to this many new tokens go to the decode kernel, a query per token (it
        # reads their keys once per token); longer ones to the extend kernel. Decodes alone by
        # default; speculative decoding raises it to K + 1, so a verification's rows are
        # attended as decodes are.
        self.max_query = max_query

    def prepare(self, layout: BatchLayout) -> TritonMetadata:
        device = self.req_table.table.device
        lens, prefix = layout.extend_lens, layout.prefix_lens
        short = [i for i, n in enumerate(lens) if n <= self.max_query]
        longer = [i for i, n in enumerate(lens) if n > self.max_query]

        def ints(values: object, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return host_tensor(list(values), dtype, device)

        starts = token_starts(lens)
        queries = None
        if short:
            seq = [prefix[i] + j + 1 for i in short for j in range(lens[i])]
            if not longer and len(seq) == len(lens):  # a decode step: one query a request, in order
                tokens, rows = torch.arange(len(lens), device=device), layout.req_slots
            else:
                tokens = ints([starts[i] + j for i in short for j in range(lens[i])], torch.int64)
                rows = layout.req_slots[ints([i for i in short for _ in range(lens[i])], torch.int64)]
            queries = QueryRun(tokens, rows, ints(seq), self.kernels.split_count(max(seq)))
        extend = None
        if longer:
            extend = ExtendRun(
                layout.req_slots[ints(longer, torch.int64)] if short else layout.req_slots,
                ints(starts[i] for i in longer), ints(lens[i] for i in longer),
                ints(prefix[i] for i in longer), max(lens[i] for i in longer),
            )
        return TritonMetadata(layout.out_loc, queries, extend)

    def graph_metadata(self, inputs: DecodeGraphInputs, batch_size: int) -> TritonMetadata:
        """Metadata for a CUDA graph's static buffers (engine/cuda_graph.py), computed from them
        inside the graph: every row a one-token query for the decode kernel, request i owning
        `tokens_per_req` rows of which it runs `q_len` (the rest, and padding requests, see
        no keys and come out zero). A graph replays at any context length: the split dimension
        covers the most splits a query can have."""
        q = inputs.tokens_per_req
        rows, seq_lens = inputs.req_rows[:batch_size], inputs.seq_lens[:batch_size]
        tokens = torch.arange(batch_size * q, device=rows.device)
        if q > 1:
            j = torch.arange(q, dtype=torch.int32, device=rows.device)[None, :]
            per_query = inputs.prefix_len[:batch_size, None] + j + 1
            seq_lens = torch.where(j < inputs.q_len[:batch_size, None], per_query, 0).reshape(-1)
            rows = rows[:, None].expand(batch_size, q).reshape(-1)
        return TritonMetadata(inputs.out_loc[: batch_size * q],
                              QueryRun(tokens, rows, seq_lens, self.kernels.MAX_DECODE_SPLITS), None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: TritonMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        k_pool, v_pool, table = self.pool.k[layer_id], self.pool.v[layer_id], self.req_table.table
        if (run := metadata.queries) is not None:
            self.kernels.decode_attention(q, k_pool, v_pool, out, table, run.tokens, run.rows, run.seq_lens,
                                          self.scale, grid_splits=run.grid_splits)
        if (ext := metadata.extend) is not None:
            self.kernels.extend_attention(q, k_pool, v_pool, out, table, ext.rows, ext.q_start, ext.q_len,
                                          ext.prefix_len, ext.max_q_len, self.scale)
        return out
