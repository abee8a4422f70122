"""The C paged-attention kernel for the CPU (`--attention-backend cpu`, the default there).

Decodes and short extends (at most `KERNEL_MAX_QUERY` new tokens) go to the kernel, which reads K/V
straight from the pool through the page table (no gathered copy); longer extends go to the
`sdpa` backend, whose flash kernel blocks the query-key products and wins on long runs. The
kernel takes a float32 model with a float32 or bfloat16 pool; `is_supported` says when it
can run at all (CPU, those dtypes, the library built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_mp.attention.base import AttentionBackend, BatchLayout
from minisgl_mp.attention.sdpa import SdpaBackend, SdpaPlan, token_starts
from minisgl_mp.kernels import cpu as cpu_kernel
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable

# Query runs up to this long go to the kernel: its cost grows with queries x keys without the
# matrix-product blocking of SDPA's flash kernel. Set from the crossover measured against the
# 4-D sdpa path (launch/bench_attention_crossover.py; docs/benchmarks.md, "Attention backends").
KERNEL_MAX_QUERY = 16


@dataclass(frozen=True)
class KernelRun:
    """Requests for the C kernel. All int64 CPU tensors, one entry per request."""

    kv_index: torch.Tensor  # [Bk, L] page-table rows
    q_start: torch.Tensor  # first token row of each request in the batch
    q_len: torch.Tensor
    kv_len: torch.Tensor


@dataclass(frozen=True)
class CpuMetadata:
    out_loc: torch.Tensor
    kernel: KernelRun | None
    rest: SdpaPlan | None  # requests longer than the kernel takes


def is_supported(pool: KVPool, dtype: torch.dtype) -> bool:
    return (pool.k.device.type == "cpu" and dtype == torch.float32 and pool.k.dtype in cpu_kernel.KV_DTYPES
            and cpu_kernel.load() is not None)


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | None = None, max_query: int = KERNEL_MAX_QUERY) -> None:
        self.pool = pool
        self.req_table = req_table
        self.dtype = dtype or pool.k.dtype
        if not is_supported(pool, self.dtype):
            raise ValueError("the cpu attention backend needs a CPU pool, a float32 model, float32 or bfloat16 KV "
                             "and the C kernel library (a C compiler); use --attention-backend sdpa")
        self.scale = head_dim**-0.5
        self.max_query = max_query
        self.sdpa = SdpaBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype=self.dtype)

    def prepare(self, layout: BatchLayout) -> CpuMetadata:
        short = [i for i, n in enumerate(layout.extend_lens) if n <= self.max_query]
        long = [i for i, n in enumerate(layout.extend_lens) if n > self.max_query]
        kernel = None
        if short:
            starts, seq_lens = token_starts(layout.extend_lens), layout.seq_lens
            rows = layout.req_slots[short] if len(short) < layout.batch_size else layout.req_slots
            kernel = KernelRun(
                kv_index=self.req_table.table[:, : max(seq_lens[i] for i in short)].index_select(0, rows),
                q_start=torch.tensor([starts[i] for i in short]),
                q_len=torch.tensor([layout.extend_lens[i] for i in short]),
                kv_len=torch.tensor([seq_lens[i] for i in short]),
            )
        rest = self.sdpa.plan(layout, long) if long else None
        return CpuMetadata(layout.out_loc, kernel, rest)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: CpuMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.kernel is not None:
            run = metadata.kernel
            cpu_kernel.paged_attention(q, self.pool.k[layer_id], self.pool.v[layer_id], run.kv_index,
                                       run.q_start, run.q_len, run.kv_len, out, self.scale)
        if metadata.rest is not None:
            self.sdpa.attend(q, k, v, layer_id, metadata.rest, out)
        return out
