"""The C paged-attention kernel for the CPU (`--attention-backend cpu`, the default there).

Decodes and short extends (at most `KERNEL_MAX_QUERY` new tokens) go to the kernel, which reads K/V
straight from the pool through the page table (no gathered copy). Longer runs (prompts, chunks,
extends over a cached prefix) go to its blocked form (csrc/extend_attention.c: query blocks
against key tiles, float32 pools), which ran 64- to 4,096-token prompts faster than PyTorch's
flash kernel, or, for a model whose products run on AMX tiles (bfloat16 weights), to the tiles
too (csrc/amx_attention.c); over a bfloat16 pool they go to the `sdpa` backend. The kernels take a float32
model with a float32 or bfloat16 pool; `is_supported` says when they can run at all (CPU, those
dtypes, the library built).
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
# 4-D sdpa path (docs/notes/cpu-kernels.md, section 7; its script is in git history).
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
    extend: KernelRun | None  # for the blocked kernel
    rest: SdpaPlan | None  # longer requests the blocked kernel cannot take


def is_supported(pool: KVPool, dtype: torch.dtype) -> bool:
    return (pool.k.device.type == "cpu" and dtype == torch.float32 and pool.k.dtype in cpu_kernel.KV_DTYPES
            and cpu_kernel.load() is not None)


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | None = None, max_query: int = KERNEL_MAX_QUERY,
                 extend_kernel: bool = True) -> None:
        self.pool = pool
        self.req_table = req_table
        self.dtype = dtype or pool.k.dtype
        if not is_supported(pool, self.dtype):
            raise ValueError("the cpu attention backend needs a CPU pool, a float32 model, float32 or bfloat16 KV "
                             "and the C kernel library (a C compiler); use --attention-backend sdpa")
        self.scale = head_dim**-0.5
        self.max_query = max_query
        # The blocked kernel reads float32 pools, whole 32-wide chunks of a head, whole query groups.
        self.extend_kernel = (extend_kernel and pool.k.dtype == torch.float32 and head_dim % 32 == 0
                              and num_heads % num_kv_heads == 0)
        self.sdpa = SdpaBackend(pool, req_table, num_heads, num_kv_heads, head_dim, dtype=self.dtype)
        self.extend_amx = False
        self.extend_dot = False

    def use_amx_extend(self) -> bool:
        """Run the long query runs on AMX tiles (csrc/amx_attention.c: Q, K, V and the
        probabilities in bfloat16, float32 softmax and accumulation), for a model whose linear
        products already run there; returns whether this CPU, build and head dim allow it."""
        self.extend_amx = (self.extend_kernel and self.pool.k.shape[-1] <= 256 and cpu_kernel.amx_ready())
        return self.extend_amx

    def use_dot_extend(self) -> bool:
        """Run the long query runs on AVX512-BF16's dot products (csrc/bf16dot_attention.c, the
        numerics of the AMX kernel), for a model whose linear products already run there;
        returns whether this CPU and build allow it."""
        self.extend_dot = self.extend_kernel and not self.extend_amx and cpu_kernel.bf16dot_ready()
        return self.extend_dot

    def prepare(self, layout: BatchLayout) -> CpuMetadata:
        lens = layout.extend_lens
        short = [i for i, n in enumerate(lens) if n <= self.max_query]
        longer = [i for i, n in enumerate(lens) if n > self.max_query]
        extend, long = (longer, []) if self.extend_kernel else ([], longer)
        starts = token_starts(lens)
        kernel = self._run(layout, short, starts) if short else None
        extend_run = self._run(layout, extend, starts) if extend else None
        rest = self.sdpa.plan(layout, long) if long else None
        return CpuMetadata(layout.out_loc, kernel, extend_run, rest)

    def _run(self, layout: BatchLayout, reqs: list[int], starts: list[int]) -> KernelRun:
        seq_lens = layout.seq_lens
        rows = layout.req_slots[reqs] if len(reqs) < layout.batch_size else layout.req_slots
        return KernelRun(
            kv_index=self.req_table.table[:, : max(seq_lens[i] for i in reqs)].index_select(0, rows),
            q_start=torch.tensor([starts[i] for i in reqs]),
            q_len=torch.tensor([layout.extend_lens[i] for i in reqs]),
            kv_len=torch.tensor([seq_lens[i] for i in reqs]),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: CpuMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.kernel is not None:
            run = metadata.kernel
            cpu_kernel.paged_attention(q, self.pool.k[layer_id], self.pool.v[layer_id], run.kv_index,
                                       run.q_start, run.q_len, run.kv_len, out, self.scale)
        if metadata.extend is not None:
            run = metadata.extend
            cpu_kernel.extend_attention(q, self.pool.k[layer_id], self.pool.v[layer_id], run.kv_index,
                                        run.q_start, run.q_len, run.kv_len, out, self.scale, amx=self.extend_amx,
                                        dot=self.extend_dot)
        if metadata.rest is not None:
            self.sdpa.attend(q, k, v, layer_id, metadata.rest, out)
        return out
