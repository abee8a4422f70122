"""Triton paged attention: queries of one token (decodes, and the rows of a speculative
verification), and extends over a cached prefix, reading K/V straight from the pool through the
page table (no padded gather), with an online softmax in float32.

A one-token query's result depends on its own keys alone: its splits are fixed by its key
count and merged in order, so a row gives the same bits whatever else is in the batch, in a
CUDA graph or not, and a verification's rows those of the same tokens decoded one at a time
(the greedy answers of speculative decoding then match plain decoding's as far as attention
goes). The extend kernel, for prompts, attends a block of queries at once and does not.

The page table is the request table: `table[row, pos]` is the pool slot of token `pos` of the
request in `row`, whatever the page size (a page is a run of consecutive slots), so the same
kernels serve page sizes 1 to 64. Grouped-query attention reads each K/V block once per KV head.
K/V may be float32, bfloat16 or float16, and are cast to the queries' dtype on load; the
products accumulate in float32.

On the CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, read when this
module is imported): slow, but the same code, which is how CI tests them without a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
import torch


@triton.jit
def _split_count(seq_len, SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr):
    # Runs a query's keys are cut into: a function of its own key count alone, so that its
    # result does not depend on the other queries of the batch, nor on eager or graph mode.
    return tl.minimum(tl.cdiv(seq_len, SPLIT_TOKENS), MAX_SPLITS)


@triton.jit
def _attend_keys(q, K, V, Table, row, stride_table, pos, mask_n, visible, kvh, stride_kt, stride_kh, offs_d,
                 mask_d, scale, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # One block of keys (pool positions `pos` of page-table row `row`, `mask_n` those in range)
    # into the online softmax of q's rows: `visible` [rows or 1, BLOCK_N] says which keys each
    # row sees. Returns the running max, sum of exponentials and unnormalised output.
    slots = tl.load(Table + row * stride_table + pos, mask=mask_n, other=0).to(tl.int64)
    kv_off = slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps a finite max, so exp() stays 0, not NaN.
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    Q, K, V, Mid, MidLse, Table, Tokens, Rows, SeqLens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    scale, head_dim, grid_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program per (query, KV head, split of the keys): its GROUP query heads attend over
    # the split's keys. A query is one token: q row Tokens[i] sees keys 0 .. SeqLens[i] - 1 of
    # page-table row Rows[i], so a decode is one query and a verification of K drafts K + 1
    # queries of one row (causal by their key counts). Splitting the keys keeps the GPU busy
    # when queries are few and long. Writes the split's normalised output to
    # Mid [N, Hq, grid_splits, D] and its log-sum-exp to MidLse [N, Hq, grid_splits]; splits
    # past the query's own count write nothing.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    num_splits = _split_count(seq_len, SPLIT_TOKENS, MAX_SPLITS)
    if split < num_splits:
        token = tl.load(Tokens + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < GROUP
        mask_d = offs_d < head_dim
        heads = kvh * GROUP + offs_g
        q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < hi
            m_i, l_i, acc = _attend_keys(q, K, V, Table, row, stride_table, pos, mask_n, mask_n[None, :], kvh,
                                         stride_kt, stride_kh, offs_d, mask_d, scale, m_i, l_i, acc,
                                         DOT_DTYPE, DOT_PRECISION)
        # A split without keys (none: SPLIT_TOKENS >= MAX_SPLITS * BLOCK_N, checked at import)
        # would write 0 and -inf, which the merge weighs 0.
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        mid_row = (b * tl.num_programs(1) * GROUP + heads) * grid_splits + split  # [BLOCK_G]
        tl.store(Mid + mid_row[:, None] * head_dim + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
        tl.store(MidLse + mid_row, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    Mid, MidLse, Out, Tokens, SeqLens, stride_ot, stride_oh, head_dim, grid_splits,
    SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (query, query head): the query's splits merged one after another in
    # their order, each weighted by its share of the softmax mass, so the sum runs the same
    # way whatever the grid. A query with no keys (a CUDA-graph bucket's padding) writes zeros.
    b = tl.program_id(0)
    h = tl.program_id(1)
    token = tl.load(Tokens + b).to(tl.int64)
    num_splits = _split_count(tl.load(SeqLens + b), SPLIT_TOKENS, MAX_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    base = (b * tl.num_programs(1) + h) * grid_splits
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(MidLse + base + s)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        part = tl.load(Mid + (base + s) * head_dim + offs_d, mask=mask_d, other=0.0)
        total = total * alpha + w
        acc = acc * alpha + part * w
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + token * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, Rows, QStart, QLen, PrefixLen,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_table,
    scale, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program per (request, query head, block of BLOCK_M new tokens). Query i of a request
    # sits at position prefix_len + i and sees keys 0 ..= prefix_len + i, all read from the pool
    # (the new tokens' K/V are stored before the kernel runs).
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)
    q_len = tl.load(QLen + b)
    if mblock * BLOCK_M < q_len:
        q_start = tl.load(QStart + b)
        prefix = tl.load(PrefixLen + b)
        row = tl.load(Rows + b)
        kvh = h // GROUP
        offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = offs_m < q_len
        mask_d = offs_d < head_dim
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
        q_pos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past the block's last query are masked for every row of it: stop there.
        end = tl.minimum(prefix + q_len, prefix + (mblock + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            pos = start + offs_n
            mask_n = pos < end
            # Causal: each row sees the keys up to its own position.
            visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _attend_keys(q, K, V, Table, row, stride_table, pos, mask_n, visible, kvh,
                                         stride_kt, stride_kh, offs_d, mask_d, scale, m_i, l_i, acc,
                                         DOT_DTYPE, DOT_PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _block_d(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)


# NOTE: the interpreter (Triton 3.9) computes tl.dot on bfloat16 operands wrongly (garbage of
# order 1e10 where float32 and float16 are exact): under it, bfloat16 products run in float32.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.bfloat16:
        return tl.float32 if _INTERPRET else tl.bfloat16
    return {torch.float32: tl.float32, torch.float16: tl.float16}[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 products in full float32: Triton's default for them is TF32 (10-bit mantissas),
    which a user who asked for float32 would not expect (PyTorch's matmuls default to full)."""
    return "ieee" if _dot_dtype(dtype) == tl.float32 else "tf32"


# A query's keys are cut into one run per SPLIT_TOKENS of them, at most MAX_DECODE_SPLITS
# (flash decoding): a few long requests still fill the GPU, and short ones are not cut into runs
# too small to pay for the merge. The runs depend on the query's own key count alone.
MAX_DECODE_SPLITS = 16
SPLIT_TOKENS = 512
DECODE_BLOCK_N = 32
# Rounding each split up to whole blocks of DECODE_BLOCK_N keys then never leaves the last one empty.
assert SPLIT_TOKENS >= MAX_DECODE_SPLITS * DECODE_BLOCK_N, "a split could have no keys"


def split_count(seq_len: int) -> int:
    """Runs the decode kernel cuts a query over `seq_len` keys into (0 for no keys)."""
    return min(-(-seq_len // SPLIT_TOKENS), MAX_DECODE_SPLITS)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                     tokens: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     grid_splits: int = MAX_DECODE_SPLITS) -> None:
    """Queries of one token each over the pool. q, out: [T, Hq, D]; k, v: [S, Hkv, D] (one layer
    of the pool); table: [R, ctx] slots; per query [N]: `tokens` its row of q and out, `rows` its
    page-table row, `seq_lens` the keys it sees (its position + 1: its own K/V are already in
    the pool). A decode step is one query a request; a verification of K drafts is K + 1
    queries of the same row, causal through their key counts, so each of its rows is computed
    exactly as that row decoded alone. grid_splits: at least the largest `split_count` of the
    queries (a CUDA graph, which replays at any length, passes MAX_DECODE_SPLITS)."""
    n = tokens.numel()
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    group = hq // hkv
    # Partial results: [N, Hq, splits, D] outputs and [N, Hq, splits] log-sum-exps, float32.
    mid = torch.empty((n, hq, grid_splits, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((n, hq, grid_splits), dtype=torch.float32, device=q.device)
    # tl.dot wants at least 16 rows: the group is padded with masked heads.
    _decode_kernel[(n, hkv, grid_splits)](
        q, k, v, mid, mid_lse, table, tokens, rows, seq_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0),
        scale, d, grid_splits, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_D=_block_d(d), SPLIT_TOKENS=SPLIT_TOKENS, MAX_SPLITS=MAX_DECODE_SPLITS,
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype),
    )
    _decode_reduce_kernel[(n, hq)](mid, mid_lse, out, tokens, seq_lens, out.stride(0), out.stride(1), d,
                                   grid_splits, SPLIT_TOKENS=SPLIT_TOKENS, MAX_SPLITS=MAX_DECODE_SPLITS,
                                   BLOCK_D=_block_d(d))


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, prefix_len: torch.Tensor,
                     max_q_len: int, scale: float, block_m: int = 16, block_n: int = 32) -> None:
    """Causal attention of each request's new tokens over its prefix and themselves.
    q, out: [T, Hq, D]; k, v: [S, Hkv, D]; table: [R, ctx]; rows, q_start, q_len, prefix_len: [B].
    max_q_len: the longest q_len (sizes the grid; a host value, so no sync)."""
    batch = rows.numel()
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    grid = (batch, hq, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k, v, out, table, rows, q_start, q_len, prefix_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), table.stride(0),
        scale, d, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(d),
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION=_dot_precision(q.dtype),
    )
