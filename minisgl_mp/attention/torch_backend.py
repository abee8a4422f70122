"""Attention in PyTorch, with the C paged-attention kernel for short query runs on the CPU.

A batch's requests split three ways, once per forward in `prepare`:
- short runs (decodes, and extends of at most KERNEL_MAX_QUERY tokens) go to the C kernel
  when it is available (CPU, float32 model, float32 or bfloat16 KV pool): it reads K/V straight
  from the pool through the page table, with no gathered copy;
- otherwise decodes gather their K/V into a padded [B, L] batch (a reused workspace) and attend
  in one scaled_dot_product_attention call, the Hq / Hkv query heads of a KV head folded into
  the query length so grouped-query attention needs no K/V expansion;
- K/V read back from a pool of another dtype than the model's (`--kv-cache-dtype`) are cast to
  the model's dtype after the gather; a prefill's own new K/V are used as computed;
- longer extends (more than KERNEL_MAX_QUERY new tokens) run one scaled_dot_product_attention
  call each: they carry many tokens each, so the loop is cheap next to the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_mp.kernels import cpu as cpu_kernel
from minisgl_mp.attention.base import AttentionBackend, BatchLayout
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable

# Query runs up to this long go to the C kernel: its cost grows with queries x keys without a
# matrix-product blocking, which SDPA's flash kernel wins at for long prompts. Measured on the
# Qwen3-0.6B head shape (16 q / 8 kv heads of 128): a 64-token extend over a 1,088-token cached
# prefix took 18 ms in the kernel against 116 ms gathered through SDPA with a mask; 128 tokens
# 45 vs 122 ms; 256 tokens 86 vs 71 ms, where SDPA starts to win.
KERNEL_MAX_QUERY = 128


@dataclass(frozen=True)
class _KernelRun:
    """Requests for the C kernel. All int64 CPU tensors, one entry per request."""

    kv_index: torch.Tensor  # [Bk, L] page-table rows
    q_start: torch.Tensor  # first token row of each request in the batch
    q_len: torch.Tensor
    kv_len: torch.Tensor


@dataclass(frozen=True)
class _PaddedDecode:
    rows: torch.Tensor  # [Bd] token rows of the decoding requests in the batch
    kv_index: torch.Tensor  # [Bd, L] KV slots, the pad slot past each request's length
    mask: torch.Tensor | None  # [Bd, 1, 1, L] True where a key is real; None if none is padding


@dataclass(frozen=True)
class _ExtendSeq:
    q_start: int
    q_end: int
    kv_index: torch.Tensor | None  # [S] slots of prefix + new tokens; None: no prefix, use k/v as given
    mask: torch.Tensor | None  # [n, S] causal mask shifted by the prefix; None: plain causal


@dataclass(frozen=True)
class _Metadata:
    out_loc: torch.Tensor
    kernel: _KernelRun | None
    decode: _PaddedDecode | None
    seqs: tuple[_ExtendSeq, ...]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, use_cpu_kernel: bool = True, dtype: torch.dtype | None = None) -> None:
        """dtype: the model's (queries, outputs); default the pool's."""
        self.pool = pool
        self.dtype = dtype or pool.k.dtype
        self.req_table = req_table
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.use_cpu_kernel = (use_cpu_kernel and pool.k.device.type == "cpu"
                               and self.dtype == torch.float32 and pool.k.dtype in cpu_kernel.KV_DTYPES
                               and cpu_kernel.load() is not None)
        # Gathered K/V of a padded decode batch, reused layer after layer and step after step:
        # a fresh tensor of this size per layer costs more in page faults than the copy.
        self._k_buf = torch.empty(0, num_kv_heads, head_dim, dtype=pool.k.dtype, device=pool.k.device)
        self._v_buf = torch.empty_like(self._k_buf)

    def prepare(self, layout: BatchLayout) -> _Metadata:
        table = self.req_table.table
        device = table.device
        slots = layout.req_slots.tolist()
        starts, start = [], 0
        for n in layout.extend_lens:
            starts.append(start)
            start += n
        kernel, decode, long = [], [], []
        for i, (cached, n) in enumerate(zip(layout.cached_lens, layout.extend_lens)):
            if self.use_cpu_kernel and n <= KERNEL_MAX_QUERY:
                kernel.append(i)
            elif n == 1 and cached > 0:
                decode.append(i)
            else:
                long.append(i)
        seq_lens = layout.seq_lens

        kernel_run = None
        if kernel:
            rows = torch.tensor([slots[i] for i in kernel], device=device)
            kernel_run = _KernelRun(
                kv_index=table[:, : max(seq_lens[i] for i in kernel)].index_select(0, rows),
                q_start=torch.tensor([starts[i] for i in kernel]),
                q_len=torch.tensor([layout.extend_lens[i] for i in kernel]),
                kv_len=torch.tensor([seq_lens[i] for i in kernel]),
            )

        padded = None
        if decode:
            lens = [seq_lens[i] for i in decode]
            max_len = max(lens)
            kv_index = table[:, :max_len].index_select(0, torch.tensor([slots[i] for i in decode], device=device))
            mask = None
            if min(lens) != max_len:
                valid = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
                # Past a request's length the table holds stale slots: read the zero pad slot.
                kv_index = kv_index.masked_fill(~valid, self.pool.pad_slot)
                mask = valid[:, None, None, :]
            padded = _PaddedDecode(torch.tensor([starts[i] for i in decode], device=device), kv_index, mask)

        seqs = []
        for i in long:
            cached, n, row = layout.cached_lens[i], layout.extend_lens[i], slots[i]
            kv_index = mask = None
            if cached > 0:
                kv_index = table[row, : cached + n]
                if n > 1:
                    q_pos = torch.arange(cached, cached + n, device=device)
                    mask = torch.arange(cached + n, device=device)[None, :] <= q_pos[:, None]
            seqs.append(_ExtendSeq(starts[i], starts[i] + n, kv_index, mask))
        return _Metadata(layout.out_loc, kernel_run, padded, tuple(seqs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: _Metadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if metadata.kernel is not None:
            run = metadata.kernel
            cpu_kernel.paged_attention(q, self.pool.k[layer_id], self.pool.v[layer_id], run.kv_index,
                                       run.q_start, run.q_len, run.kv_len, out, self.scale)
        if metadata.decode is not None:
            out[metadata.decode.rows] = self._padded_decode(q[metadata.decode.rows], layer_id, metadata.decode)
        if metadata.seqs:
            self._extend(q, k, v, layer_id, metadata.seqs, out)
        return out

    def _gather(self, layer_id: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in `index` ([B, L]) as [B, L, Hkv, D] views of the workspace."""
        n = index.numel()
        if self._k_buf.shape[0] < n:
            self._k_buf = self._k_buf.new_empty((n, self.num_kv_heads, self.head_dim))
            self._v_buf = torch.empty_like(self._k_buf)
        flat = index.reshape(-1)
        k = torch.index_select(self.pool.k[layer_id], 0, flat, out=self._k_buf[:n])
        v = torch.index_select(self.pool.v[layer_id], 0, flat, out=self._v_buf[:n])
        shape = (*index.shape, self.num_kv_heads, self.head_dim)
        return k.view(shape).to(self.dtype), v.view(shape).to(self.dtype)

    def _padded_decode(self, q: torch.Tensor, layer_id: int, meta: _PaddedDecode) -> torch.Tensor:
        b, d = q.shape[0], self.head_dim
        k, v = self._gather(layer_id, meta.kv_index)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
        # q: [B, Hq, D] -> [B, Hkv, G, D]: a KV head's group of query heads acts as its queries.
        qg = q.view(b, self.num_kv_heads, self.group, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                seqs: tuple[_ExtendSeq, ...], out: torch.Tensor) -> None:
        k_pool, v_pool = self.pool.k[layer_id], self.pool.v[layer_id]
        for s in seqs:
            qi = q[s.q_start : s.q_end].transpose(0, 1)  # [Hq, n, D]
            if s.kv_index is None:
                ki = k[s.q_start : s.q_end].transpose(0, 1)
                vi = v[s.q_start : s.q_end].transpose(0, 1)
            else:
                ki = k_pool[s.kv_index].to(q.dtype).transpose(0, 1)  # [Hkv, S, D]
                vi = v_pool[s.kv_index].to(q.dtype).transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=s.mask, is_causal=s.kv_index is None,
                scale=self.scale, enable_gqa=self.group > 1,
            )
            out[s.q_start : s.q_end] = oi.transpose(0, 1)
