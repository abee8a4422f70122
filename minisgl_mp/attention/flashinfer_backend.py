"""FlashInfer's paged attention (`--attention-backend flashinfer`, the CUDA default when the
package is installed).

NOTE: written against FlashInfer's documented wrapper API (`BatchPrefillWithPagedKVCacheWrapper`,
`BatchDecodeWithPagedKVCacheWrapper`: plan once per step, run per layer) and never run where it
was written, which has no GPU; `launch/gpu_check.py` checks it against sdpa on a GPU. The index
building below is plain torch and is tested on the CPU.

The pool is handed to FlashInfer as pages of one token: layer l's K is `pool.k[l]`
([slots, Hkv, D]) viewed as [slots, 1, Hkv, D] (the "NHD" layout), and a request's page list
is its page-table row, `table[row, :seq_len]`. That works for every `--page-size` (a page of
ours is a run of consecutive slots) and is how SGLang drives FlashInfer. New tokens' K/V are
stored before attention, so an extend attends over the pool alone; FlashInfer's causal mask
is aligned bottom-right, which is what an extend over a cached prefix needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from minisgl_mp.attention.base import AttentionBackend, BatchLayout
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.utils.device import host_tensor

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's scratch for split-KV partial results


def indptr(lengths: Sequence[int]) -> torch.Tensor:
    """[B + 1] int32 prefix sums on the host: FlashInfer's plan reads them there (no sync)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def flat_kv_indices(table: torch.Tensor, rows: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
    """table[rows[i], :seq_lens[i]] for every request, concatenated: [sum(seq_lens)] int32 on
    the table's device, built with vector operations (the total is known on the host, so no
    device sync)."""
    total = sum(seq_lens)
    device = table.device
    lens = host_tensor(list(seq_lens), torch.int64, device)
    starts = torch.cumsum(lens, 0) - lens
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens, output_size=total)
    pos = torch.arange(total, device=device) - starts[req]
    return table[rows.to(device)[req], pos].to(torch.int32)


@dataclass(frozen=True)
class FlashInferMetadata:
    out_loc: torch.Tensor
    decode: bool  # which wrapper was planned for this step


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | None = None) -> None:
        import flashinfer  # only here: the package exists on CUDA machines alone

        if pool.k.device.type != "cuda":
            raise ValueError("the flashinfer backend runs on CUDA only")
        self.pool = pool
        self.req_table = req_table
        self.dtype = dtype or pool.k.dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.k.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Tensor cores pay off for decode once a KV head serves several query heads (SGLang's rule).
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4)

    def prepare(self, layout: BatchLayout) -> FlashInferMetadata:
        """Plans the step's wrapper once; every layer then runs it."""
        seq_lens = layout.seq_lens
        kv_indptr = indptr(seq_lens)
        kv_indices = flat_kv_indices(self.req_table.table, layout.req_slots, seq_lens)
        last_page_len = torch.ones(layout.batch_size, dtype=torch.int32)  # pages of one token
        decode = all(n == 1 for n in layout.extend_lens)
        common: dict[str, Any] = dict(q_data_type=self.dtype, kv_data_type=self.pool.k.dtype, sm_scale=self.scale)
        if decode:
            self.decode.plan(kv_indptr, kv_indices, last_page_len, self.num_heads, self.num_kv_heads,
                             self.head_dim, 1, **common)
        else:
            self.prefill.plan(indptr(layout.extend_lens), kv_indptr, kv_indices, last_page_len, self.num_heads,
                              self.num_kv_heads, self.head_dim, 1, causal=True, **common)
        return FlashInferMetadata(layout.out_loc, decode)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: FlashInferMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        shape = (-1, 1, self.num_kv_heads, self.head_dim)
        cache = (self.pool.k[layer_id].view(shape), self.pool.v[layer_id].view(shape))
        wrapper = self.decode if metadata.decode else self.prefill
        return wrapper.run(q.contiguous(), cache)
