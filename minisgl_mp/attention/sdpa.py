"""Attention through PyTorch's scaled_dot_product_attention (`--attention-backend sdpa`).

Every call passes 4-D [batch, heads, tokens, head_dim] tensors: PyTorch dispatches its fused
kernels (flash / memory-efficient on CUDA, the flash kernel on the CPU) only for 4-D inputs;
3-D ones fall to the unfused math path, which materialises the whole score matrix.

- Extends (prefill, prefill chunks, extends over a radix-cache hit) run one call per request.
  Without a cached prefix the new K/V are used as computed, with `is_causal`; over a prefix,
  the request's K/V are gathered from the pool (prefix and new tokens, which `forward` has just
  stored) and masked lower-right causal: query i sits at position prefix + i (see `_lower_right`).
- Decodes (one new token over a cached prefix) gather their K/V into a padded batch and attend
  in one call, the Hq / Hkv query heads of a KV head folded into the query length so grouped-
  query attention needs no K/V expansion. Requests are sorted by length and cut into chunks of
  at most `max_gather_tokens` padded tokens, so one long request among many short ones pads
  only its own chunk (a chunk of one when it is longer than the budget by itself).
- K/V read back from a pool of another dtype than the model's (`--kv-cache-dtype`) are cast to
  the model's dtype after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from minisgl_mp.attention.base import AttentionBackend, BatchLayout
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.utils.device import host_tensor

# Padded decode tokens gathered at once: 64k tokens of the Qwen3-0.6B shape (8 KV heads of 128)
# are 256 MiB of K+V in float32, 128 MiB in bfloat16.
MAX_GATHER_TOKENS = 1 << 16


@dataclass(frozen=True)
class DecodeChunk:
    rows: torch.Tensor  # [b] token rows of these decodes in the batch
    kv_index: torch.Tensor  # [b, L] KV slots, the pad slot past each request's length
    mask: torch.Tensor | None  # [b, 1, 1, L] True where a key is real; None if none is padding


@dataclass(frozen=True)
class ExtendSeq:
    q_start: int
    q_len: int
    kv_index: torch.Tensor | None  # [S] slots of prefix + new tokens; None: no prefix, use k/v as given


@dataclass(frozen=True)
class SdpaPlan:
    decodes: tuple[DecodeChunk, ...]
    extends: tuple[ExtendSeq, ...]


@dataclass(frozen=True)
class SdpaMetadata:
    out_loc: torch.Tensor
    plan: SdpaPlan


def token_starts(extend_lens: Sequence[int]) -> list[int]:
    """First batch row of each request's tokens."""
    starts, start = [], 0
    for n in extend_lens:
        starts.append(start)
        start += n
    return starts


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | None = None, max_gather_tokens: int = MAX_GATHER_TOKENS) -> None:
        """dtype: the model's (queries, outputs); default the pool's."""
        self.pool = pool
        self.req_table = req_table
        self.dtype = dtype or pool.k.dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.max_gather_tokens = max_gather_tokens
        # Gathered K/V of a padded decode chunk, reused layer after layer and step after step:
        # a fresh tensor of this size per layer costs more in page faults than the copy.
        self._k_buf = torch.empty(0, num_kv_heads, head_dim, dtype=pool.k.dtype, device=pool.k.device)
        self._v_buf = torch.empty_like(self._k_buf)

    def prepare(self, layout: BatchLayout) -> SdpaMetadata:
        return SdpaMetadata(layout.out_loc, self.plan(layout, range(layout.batch_size)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: SdpaMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        out = torch.empty_like(q)
        self.attend(q, k, v, layer_id, metadata.plan, out)
        return out

    def plan(self, layout: BatchLayout, requests: Sequence[int]) -> SdpaPlan:
        """The work for the requests at these batch indices (another backend may take the rest)."""
        # Index tensors are built from host lengths; the page-table rows are only ever indexed
        # with, never read back (on CUDA that would wait for the device).
        table, device = self.req_table.table, self.req_table.table.device
        req_slots = layout.req_slots.to(device)
        starts = token_starts(layout.extend_lens)
        seq_lens = layout.seq_lens
        decode = [i for i in requests if layout.extend_lens[i] == 1 and layout.prefix_lens[i] > 0]
        extend = [i for i in requests if not (layout.extend_lens[i] == 1 and layout.prefix_lens[i] > 0)]

        chunks = []
        for group in self._decode_groups(sorted(decode, key=lambda i: seq_lens[i]), seq_lens):
            lens = [seq_lens[i] for i in group]
            max_len = lens[-1]
            rows = req_slots[host_tensor(group, torch.int64, device)]
            kv_index = table[:, :max_len].index_select(0, rows)
            mask = None
            if lens[0] != max_len:
                valid = torch.arange(max_len, device=device)[None, :] < host_tensor(lens, torch.int64, device)[:, None]
                # Past a request's length the table holds stale slots: read the pad slot instead.
                kv_index = kv_index.masked_fill(~valid, self.pool.pad_slot)
                mask = valid[:, None, None, :]
            chunks.append(DecodeChunk(host_tensor([starts[i] for i in group], torch.int64, device), kv_index, mask))

        seqs = []
        for i in extend:
            cached, n = layout.prefix_lens[i], layout.extend_lens[i]
            kv_index = table[:, : cached + n].index_select(0, req_slots[i : i + 1])[0] if cached > 0 else None
            seqs.append(ExtendSeq(starts[i], n, kv_index))
        return SdpaPlan(tuple(chunks), tuple(seqs))

    def _decode_groups(self, order: list[int], seq_lens: tuple[int, ...]) -> list[list[int]]:
        """Consecutive runs of `order` (sorted by length) whose padded size fits the budget."""
        groups: list[list[int]] = []
        for i in order:
            # Sorted ascending: the newest member is the chunk's longest.
            if groups and (len(groups[-1]) + 1) * seq_lens[i] <= self.max_gather_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, plan: SdpaPlan,
               out: torch.Tensor) -> None:
        """out[rows of the planned requests] = their attention. q: [T, Hq, D]; k, v: [T, Hkv, D]."""
        for chunk in plan.decodes:
            out[chunk.rows] = self._decode(q[chunk.rows], layer_id, chunk)
        k_pool, v_pool = self.pool.k[layer_id], self.pool.v[layer_id]
        for s in plan.extends:
            rows = slice(s.q_start, s.q_start + s.q_len)
            qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if s.kv_index is None:
                ki = k[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                vi = v[rows].transpose(0, 1).unsqueeze(0)
                mask, causal = None, True
            else:
                ki = k_pool[s.kv_index].to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
                vi = v_pool[s.kv_index].to(q.dtype).transpose(0, 1).unsqueeze(0)
                mask, causal = self._lower_right(s.q_len, ki.shape[2], q.device), False
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                enable_gqa=self.group > 1)
            out[rows] = oi[0].transpose(0, 1)

    def _lower_right(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | object:
        """Causal mask of q_len queries at the end of kv_len keys. On CUDA, PyTorch's
        `causal_lower_right` bias, which its memory-efficient kernel applies without building
        the [q_len, kv_len] mask; elsewhere PyTorch would build that mask anyway, so it is
        built here (and `torch.nn.attention.bias`, whose import pulled in seconds of the
        compiler stack at every start-up, is never imported on the CPU)."""
        if device.type == "cuda":
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(q_len, kv_len)
        return torch.arange(kv_len, device=device)[None, :] <= torch.arange(kv_len - q_len, kv_len, device=device)[:, None]

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

    def _decode(self, q: torch.Tensor, layer_id: int, chunk: DecodeChunk) -> torch.Tensor:
        b, d = q.shape[0], self.head_dim
        k, v = self._gather(layer_id, chunk.kv_index)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, Hkv, L, D]
        # q: [b, Hq, D] -> [b, Hkv, G, D]: a KV head's group of query heads acts as its queries.
        qg = q.reshape(b, self.num_kv_heads, self.group, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=chunk.mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)
