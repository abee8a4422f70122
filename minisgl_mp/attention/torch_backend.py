"""Attention in plain PyTorch (scaled_dot_product_attention); runs on CPU and GPU.

Decode gathers each request's K/V from the pool into a padded [B, L] batch once per layer and
attends in one call. The Hq / Hkv query heads that share a KV head are folded into the query
length, so grouped-query attention needs no K/V expansion. Extend runs one call per request:
prefills carry many tokens each, so the loop is cheap next to the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_mp.attention.base import AttentionBackend, BatchLayout, ForwardMode
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable


@dataclass(frozen=True)
class _DecodeMeta:
    out_loc: torch.Tensor
    kv_index: torch.Tensor  # [B, L] KV slots, padded past each request's length
    mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is real; None if none is padding


@dataclass(frozen=True)
class _ExtendSeq:
    q_start: int
    q_end: int
    kv_index: torch.Tensor | None  # [S] slots of prefix + new tokens; None: no prefix, use k/v as given
    mask: torch.Tensor | None  # [n, S] causal mask shifted by the prefix; None: plain causal


@dataclass(frozen=True)
class _ExtendMeta:
    out_loc: torch.Tensor
    seqs: tuple[_ExtendSeq, ...]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_table: ReqTable, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        self.pool = pool
        self.req_table = req_table
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def prepare(self, layout: BatchLayout) -> _DecodeMeta | _ExtendMeta:
        table = self.req_table.table
        device = table.device
        if layout.mode is ForwardMode.DECODE:
            seq_lens = layout.seq_lens
            max_len = max(seq_lens)
            kv_index = table.index_select(0, layout.req_slots)[:, :max_len]
            mask = None
            if min(seq_lens) != max_len:
                lens = torch.tensor(seq_lens, device=device)
                valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
                # Past a request's length the table holds stale slots: read the zero pad slot.
                kv_index = kv_index.masked_fill(~valid, self.pool.pad_slot)
                mask = valid[:, None, None, :]
            return _DecodeMeta(layout.out_loc, kv_index, mask)

        seqs = []
        start = 0
        slots = layout.req_slots.tolist()
        for row, cached, n in zip(slots, layout.cached_lens, layout.extend_lens):
            kv_index = mask = None
            if cached > 0:
                kv_index = table[row, : cached + n]
                if n > 1:
                    q_pos = torch.arange(cached, cached + n, device=device)
                    mask = torch.arange(cached + n, device=device)[None, :] <= q_pos[:, None]
            seqs.append(_ExtendSeq(start, start + n, kv_index, mask))
            start += n
        return _ExtendMeta(layout.out_loc, tuple(seqs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: _DecodeMeta | _ExtendMeta) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        if isinstance(metadata, _DecodeMeta):
            return self._decode(q, layer_id, metadata)
        return self._extend(q, k, v, layer_id, metadata)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: _DecodeMeta) -> torch.Tensor:
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        # [B, L, Hkv, D] -> [B, Hkv, L, D]
        k = self.pool.k[layer_id][meta.kv_index].transpose(1, 2)
        v = self.pool.v[layer_id][meta.kv_index].transpose(1, 2)
        # q: [B, Hq, D] -> [B, Hkv, G, D]: a KV head's group of query heads acts as its queries.
        qg = q.view(b, hkv, self.group, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: _ExtendMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        k_pool, v_pool = self.pool.k[layer_id], self.pool.v[layer_id]
        for s in meta.seqs:
            qi = q[s.q_start : s.q_end].transpose(0, 1)  # [Hq, n, D]
            if s.kv_index is None:
                ki = k[s.q_start : s.q_end].transpose(0, 1)
                vi = v[s.q_start : s.q_end].transpose(0, 1)
            else:
                ki = k_pool[s.kv_index].transpose(0, 1)  # [Hkv, S, D]
                vi = v_pool[s.kv_index].transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=s.mask, is_causal=s.kv_index is None,
                scale=self.scale, enable_gqa=self.group > 1,
            )
            out[s.q_start : s.q_end] = oi.transpose(0, 1)
        return out
