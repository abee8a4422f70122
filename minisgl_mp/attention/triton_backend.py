"""Triton paged attention (`--attention-backend triton`; the CUDA default without FlashInfer).

`prepare` turns the batch layout into a few [B] index tensors on the device, once per forward;
every layer then launches one kernel (kernels/triton_attention.py) that reads K/V through the
page table. A batch of decodes only (each request one new token over its prefix) uses the
decode kernel, which reads each K/V block once per KV head for all its query heads; any other
batch uses the extend kernel, which covers decodes too.

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
class TritonMetadata:
    out_loc: torch.Tensor  # [T]
    rows: torch.Tensor  # [B] page-table rows
    seq_lens: torch.Tensor  # [B] prefix + new tokens
    decode: bool  # every request has exactly one new token
    decode_splits: int = 1  # decode: runs each request's keys are cut into
    # extend only (None for decode):
    q_start: torch.Tensor | None = None  # [B] first token row in the batch
    q_len: torch.Tensor | None = None  # [B]
    prefix_len: torch.Tensor | None = None  # [B]
    max_q_len: int = 1
    # Rows no query of the kernel writes (a verify graph's padding): zeroed, not left as
    # whatever the memory held, so the layers after see finite values.
    has_pad_rows: bool = False


# Decode cuts each request's keys into up to this many runs attended in parallel (flash
# decoding), about one per SPLIT_TOKENS keys of the longest request: a few long requests still
# fill the GPU, and short ones are not cut into runs too small to pay for the combining pass.
MAX_DECODE_SPLITS = 16
SPLIT_TOKENS = 512


def decode_splits(max_seq_len: int) -> int:
    """A power of two (the kernel's tl.arange needs one) in [1, MAX_DECODE_SPLITS]."""
    splits = 1
    while splits < MAX_DECODE_SPLITS and splits * SPLIT_TOKENS < max_seq_len:
        splits *= 2
    return splits


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
                 head_dim: int, dtype: torch.dtype | None = None) -> None:
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

    def prepare(self, layout: BatchLayout) -> TritonMetadata:
        device = self.req_table.table.device
        seq_lens = host_tensor(list(layout.seq_lens), torch.int32, device)
        if layout.mode == ForwardMode.DECODE or all(n == 1 for n in layout.extend_lens):
            return TritonMetadata(layout.out_loc, layout.req_slots, seq_lens, decode=True,
                                  decode_splits=decode_splits(max(layout.seq_lens)))

        def ints(values: object) -> torch.Tensor:
            return host_tensor(list(values), torch.int32, device)

        return TritonMetadata(
            layout.out_loc, layout.req_slots, seq_lens, decode=False,
            q_start=ints(token_starts(layout.extend_lens)), q_len=ints(layout.extend_lens),
            prefix_len=ints(layout.prefix_lens), max_q_len=max(layout.extend_lens),
        )

    def graph_metadata(self, inputs: DecodeGraphInputs, batch_size: int) -> TritonMetadata:
        """Metadata as views of a CUDA graph's static buffers (engine/cuda_graph.py): the decode
        kernel's, or for a verify graph the extend kernel's, each request owning
        `tokens_per_req` rows of which it runs `q_len`."""
        q = inputs.tokens_per_req
        rows, seq_lens = inputs.req_rows[:batch_size], inputs.seq_lens[:batch_size]
        if q == 1:
            # A graph is replayed at any context length: split as for the longest a request can have.
            return TritonMetadata(inputs.out_loc[:batch_size], rows, seq_lens, decode=True,
                                  decode_splits=decode_splits(self.req_table.max_context_len))
        return TritonMetadata(inputs.out_loc[: batch_size * q], rows, seq_lens, decode=False,
                              q_start=inputs.q_start[:batch_size], q_len=inputs.q_len[:batch_size],
                              prefix_len=inputs.prefix_len[:batch_size], max_q_len=q, has_pad_rows=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                metadata: TritonMetadata) -> torch.Tensor:
        self.pool.store(layer_id, metadata.out_loc, k, v)
        q = q.contiguous()
        out = torch.zeros_like(q) if metadata.has_pad_rows else torch.empty_like(q)
        k_pool, v_pool, table = self.pool.k[layer_id], self.pool.v[layer_id], self.req_table.table
        if metadata.decode:
            self.kernels.decode_attention(q, k_pool, v_pool, out, table, metadata.rows, metadata.seq_lens,
                                          self.scale, num_splits=metadata.decode_splits)
        else:
            self.kernels.extend_attention(q, k_pool, v_pool, out, table, metadata.rows, metadata.q_start,
                                          metadata.q_len, metadata.prefix_len, metadata.max_q_len, self.scale)
        return out
