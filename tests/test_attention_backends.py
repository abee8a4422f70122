"""Every attention backend against the sdpa backend, and sdpa against a plain reference, on
small shapes: ragged batches of decodes and extends, prefix hits, grouped-query heads, page
sizes 1 to 64 and the three KV dtypes. The Triton kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported) when there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minisgl_mp.attention import registry  # noqa: E402
from minisgl_mp.attention.base import BatchLayout, ForwardMode  # noqa: E402
from minisgl_mp.attention.sdpa import SdpaBackend  # noqa: E402
from minisgl_mp.kvcache.pool import KVPool  # noqa: E402
from minisgl_mp.kvcache.req_table import ReqTable  # noqa: E402
from minisgl_mp.kernels import cpu as cpu_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = registry.is_available("triton", DEVICE)


def make_batch(cached: tuple[int, ...], extend: tuple[int, ...], hkv: int, d: int, kv_dtype: torch.dtype,
               page_size: int = 1, seed: int = 0) -> tuple[KVPool, ReqTable, BatchLayout, torch.Tensor]:
    """A pool whose requests own shuffled pages (so attention must follow the table), their
    prefixes written, and the layout of one forward over them. Returns pool, table, layout and
    the [B, ctx] table rows."""
    gen = torch.Generator().manual_seed(seed)
    seq = [c + e for c, e in zip(cached, extend)]
    pages_per_req = [-(-n // page_size) for n in seq]
    num_pages = sum(pages_per_req) + 3
    pool = KVPool(1, num_pages * page_size, hkv, d, kv_dtype, DEVICE)
    table = ReqTable(len(seq) + 1, max(seq) + 8, DEVICE)
    order = torch.randperm(num_pages, generator=gen).tolist()
    for row, (n, pages) in enumerate(zip(seq, pages_per_req)):
        mine, order = order[:pages], order[pages:]
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in mine])[:n]
        table.table[row + 1, :n] = slots.to(DEVICE)  # row 0 stays unused: rows are not batch indices
    pool.k[0, :-1] = torch.randn(pool.num_slots, hkv, d, generator=gen).to(DEVICE, kv_dtype)
    pool.v[0, :-1] = torch.randn(pool.num_slots, hkv, d, generator=gen).to(DEVICE, kv_dtype)
    rows = torch.arange(1, len(seq) + 1, device=DEVICE)
    out_loc = torch.cat([table.table[r + 1, c : c + e] for r, (c, e) in enumerate(zip(cached, extend))])
    mode = ForwardMode.DECODE if all(e == 1 and c > 0 for c, e in zip(cached, extend)) else ForwardMode.EXTEND
    return pool, table, BatchLayout(mode, rows, cached, extend, out_loc), rows


def run(name: str, pool: KVPool, table: ReqTable, layout: BatchLayout, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    backend = registry.create_backend(name, pool, table, hq, hkv, d, dtype)
    return backend.forward(q, k, v, 0, backend.prepare(layout))


def qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(t, h, d, generator=gen) * s).to(DEVICE, dtype) for h, s in ((hq, 2), (hkv, 1), (hkv, 1)))


def test_sdpa_matches_a_masked_reference_per_request() -> None:
    """The sdpa backend (4-D, lower-right causal over a prefix, chunked padded decodes) against
    plain masked attention over each request's own keys."""
    hq, hkv, d = 8, 2, 32
    cached, extend = (0, 40, 7, 300, 0, 12), (9, 1, 5, 1, 1, 1)
    pool, table, layout, rows = make_batch(cached, extend, hkv, d, torch.float32)
    q, k, v = qkv(sum(extend), hq, hkv, d, torch.float32)
    # A small gather budget: the decodes split into several chunks.
    backend = SdpaBackend(pool, table, hq, hkv, d, torch.float32, max_gather_tokens=64)
    meta = backend.prepare(layout)
    assert len(meta.plan.decodes) >= 2
    out = backend.forward(q, k, v, 0, meta)
    start = 0
    for i, (c, e) in enumerate(zip(cached, extend)):
        slots = table.table[int(rows[i]), : c + e]
        ks, vs = pool.k[0, slots].transpose(0, 1), pool.v[0, slots].transpose(0, 1)
        mask = torch.arange(c + e, device=DEVICE)[None, :] <= (c + torch.arange(e, device=DEVICE))[:, None]
        want = F.scaled_dot_product_attention(q[start : start + e].transpose(0, 1), ks.repeat_interleave(hq // hkv, 0),
                                              vs.repeat_interleave(hq // hkv, 0), attn_mask=mask)
        torch.testing.assert_close(out[start : start + e], want.transpose(0, 1), atol=2e-5, rtol=1e-4)
        start += e


def test_sdpa_decode_chunks_bound_the_padded_gather() -> None:
    """One long request among short ones pads only its own chunk."""
    pool, table, layout, _ = make_batch((2000, 3, 5, 4, 6), (1, 1, 1, 1, 1), 1, 8, torch.float32)
    backend = SdpaBackend(pool, table, 2, 1, 8, torch.float32, max_gather_tokens=1024)
    chunks = backend.prepare(layout).plan.decodes
    assert sorted(c.kv_index.numel() for c in chunks) == [4 * 7, 2001]


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel cannot be built")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_sdpa(kv_dtype: torch.dtype) -> None:
    """Kernel-sized runs and longer ones in one mixed batch: the longer go to the blocked
    kernel over a float32 pool, to sdpa over a bfloat16 one."""
    if DEVICE.type != "cpu":
        pytest.skip("the C kernel is for the CPU")
    from minisgl_mp.attention.cpu import KERNEL_MAX_QUERY

    cached = (120, 0, 33, 9, 4)
    extend = (1, KERNEL_MAX_QUERY + 20, KERNEL_MAX_QUERY + 3, 5, 300)
    pool, table, layout, _ = make_batch(cached, extend, 2, 64, kv_dtype)
    q, k, v = qkv(sum(extend), 8, 2, 64, torch.float32)
    meta = registry.create_backend("cpu", pool, table, 8, 2, 64, torch.float32).prepare(layout)
    assert meta.kernel is not None and meta.kernel.q_len.tolist() == [1, 5]
    if kv_dtype == torch.float32:  # the blocked kernel reads float32 pools only
        assert meta.extend is not None and meta.extend.q_len.tolist() == [KERNEL_MAX_QUERY + 20, KERNEL_MAX_QUERY + 3, 300]
        assert meta.rest is None
    else:
        assert meta.extend is None and len(meta.rest.extends) == 3
    torch.testing.assert_close(run("cpu", pool, table, layout, q, k, v, torch.float32),
                               run("sdpa", pool, table, layout, q, k, v, torch.float32), atol=2e-5, rtol=1e-4)


TRITON_CASES = [
    # (cached, extend, hq, hkv, d, page_size, kv dtype, model dtype)
    ((5, 17, 1, 63), (1, 1, 1, 1), 4, 2, 32, 1, torch.float32, torch.float32),  # ragged decode
    ((1100, 3), (1, 1), 4, 2, 32, 16, torch.bfloat16, torch.float32),  # decode over 4 key splits
    ((0, 12, 0), (7, 20, 1), 8, 2, 64, 4, torch.float32, torch.float32),  # prefill, prefix hit, 1-token prompt
    ((30, 0, 40), (1, 19, 33), 6, 1, 40, 16, torch.bfloat16, torch.float32),  # mixed batch, bf16 KV, head_dim 40
    ((64, 3), (1, 1), 4, 4, 32, 64, torch.float16, torch.float16),  # MHA, float16, page size 64
    ((70, 0), (18, 5), 4, 2, 32, 64, torch.bfloat16, torch.bfloat16),  # bfloat16 model
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("cached,extend,hq,hkv,d,page_size,kv_dtype,dtype", TRITON_CASES)
def test_triton_matches_sdpa(cached, extend, hq, hkv, d, page_size, kv_dtype, dtype) -> None:
    pool, table, layout, _ = make_batch(cached, extend, hkv, d, kv_dtype, page_size)
    q, k, v = qkv(sum(extend), hq, hkv, d, dtype)
    # sdpa attends a fresh prompt over its K/V as computed, the kernel over what the pool holds:
    # give both K/V the pool can hold exactly.
    k, v = k.to(kv_dtype).to(dtype), v.to(kv_dtype).to(dtype)
    pool_before = (pool.k.clone(), pool.v.clone())
    got = run("triton", pool, table, layout, q, k, v, dtype)
    stored = (pool.k.clone(), pool.v.clone())
    pool.k.copy_(pool_before[0])
    pool.v.copy_(pool_before[1])
    want = run("sdpa", pool, table, layout, q, k, v, dtype)
    assert torch.equal(stored[0], pool.k) and torch.equal(stored[1], pool.v)  # same slots written
    tol = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])


def test_default_backend_and_unknown_names() -> None:
    cpu = torch.device("cpu")
    expected = "cpu" if cpu_kernel.load() is not None else "sdpa"
    assert registry.resolve_name("auto", cpu, torch.float32, torch.float32) == expected
    assert registry.resolve_name("auto", cpu, torch.bfloat16, torch.bfloat16) == "sdpa"  # kernel is float32 only
    assert registry.resolve_name("sdpa", cpu, torch.float32, torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="flashinfer"):
        registry.resolve_name("flashinfer", cpu, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        registry.resolve_name("nope", cpu, torch.float32, torch.float32)


def test_flashinfer_page_lists_follow_the_table() -> None:
    """The flashinfer backend's per-step index building (plain torch; the wrappers need a GPU)."""
    from minisgl_mp.attention.flashinfer_backend import flat_kv_indices, indptr

    table = torch.arange(40).view(4, 10)
    got = flat_kv_indices(table, torch.tensor([2, 0, 3]), [3, 1, 4])
    assert got.tolist() == [20, 21, 22, 0, 30, 31, 32, 33] and got.dtype == torch.int32
    assert indptr([3, 1, 4]).tolist() == [0, 3, 4, 8]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_decode_splits_follow_each_query_and_an_empty_row_is_zero() -> None:
    """Flash-decoding splits are set by each query's own key count: a grid with room for more
    gives the same bits, and a padding row (no keys) gives 0."""
    from minisgl_mp.kernels import triton_attention

    split_count = triton_attention.split_count
    assert [split_count(n) for n in (0, 1, 512, 513, 1100, 3000, 10**6)] == [0, 1, 1, 2, 3, 6, 16]
    pool, table, layout, rows = make_batch((1100, 37, 0), (1, 1, 1), 2, 32, torch.float32)
    q, k, v = qkv(3, 4, 2, 32, torch.float32)
    want = run("sdpa", pool, table, layout, q, k, v, torch.float32)  # (stores the new K/V)
    lens = torch.tensor([1101, 38, 0], dtype=torch.int32, device=DEVICE)
    tokens = torch.arange(3, device=DEVICE)
    outs = []
    for grid in (3, triton_attention.MAX_DECODE_SPLITS):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, pool.k[0], pool.v[0], out, table.table, tokens, rows, lens, 32**-0.5,
                                          grid_splits=grid)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][2], torch.zeros_like(outs[1][2]))
    torch.testing.assert_close(outs[0][:2], want[:2], atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_rows_give_the_same_bits_however_they_are_batched() -> None:
    """Speculative decoding's exactness on CUDA, as far as attention goes: a verification's rows
    (5 tokens over 1,100 cached, 3 key splits) beside a decode and a 30-token prompt, eagerly
    and in a padded verify graph, give bit for bit what each of those tokens gives decoded
    alone; the prompt matches sdpa; a graph's padding rows come out zero."""
    from minisgl_mp.attention.triton_backend import TritonBackend
    from minisgl_mp.engine.cuda_graph import DecodeGraphInputs

    hq, hkv, d = 4, 2, 32
    cached, extend = (1100, 40, 0), (5, 1, 30)
    pool, table, layout, rows = make_batch(cached, extend, hkv, d, torch.float32)
    q, k, v = qkv(sum(extend), hq, hkv, d, torch.float32)
    backend = TritonBackend(pool, table, hq, hkv, d, torch.float32, max_query=5)
    batched = backend.forward(q, k, v, 0, backend.prepare(layout))  # (stores every new K/V)

    def alone(req: int, j: int, token: int) -> torch.Tensor:
        one = BatchLayout(ForwardMode.DECODE, rows[req:req + 1], (cached[req] + j,), (1,),
                          table.table[rows[req], cached[req] + j].reshape(1))
        tok = slice(token, token + 1)
        return backend.forward(q[tok], k[tok], v[tok], 0, backend.prepare(one))[0]

    decoded = [alone(0, j, j) for j in range(5)] + [alone(1, 0, 5)]
    for token, want in enumerate(decoded):
        assert torch.equal(batched[token], want), f"row {token}"
    prompt = slice(6, 36)
    k[prompt], v[prompt] = k[prompt].to(pool.k.dtype), v[prompt].to(pool.k.dtype)
    sdpa = SdpaBackend(pool, table, hq, hkv, d, torch.float32)
    torch.testing.assert_close(batched[prompt], sdpa.forward(q, k, v, 0, sdpa.prepare(layout))[prompt],
                               atol=2e-5, rtol=1e-4)

    # The verification and the decode in a graph of 4 requests x 5 rows.
    inputs = DecodeGraphInputs.allocate(4, pool.pad_slot, DEVICE, tokens_per_req=5)
    two = BatchLayout(ForwardMode.EXTEND, rows[:2], cached[:2], extend[:2], layout.out_loc[:6])
    graph_rows = inputs.load(two, torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64), 4)
    padded = [torch.zeros(20, h, d, device=DEVICE) for h in (hq, hkv, hkv)]
    for buf, x in zip(padded, (q, k, v)):
        buf[graph_rows] = x[:6]
    graphed = backend.forward(*padded, 0, backend.graph_metadata(inputs, 4))
    for token, want in enumerate(decoded):
        assert torch.equal(graphed[graph_rows[token]], want), f"graph row {token}"
    pad = torch.ones(20, dtype=torch.bool)
    pad[graph_rows] = False
    assert torch.equal(graphed[pad], torch.zeros_like(graphed[pad]))


ENGINE_PROMPTS = [list(range(5, 45)), list(range(5, 30)) + [7, 8], [9, 8, 7]]


def engine_greedy(model_dir, backend: str) -> list[list[int]]:
    """Greedy tokens of ENGINE_PROMPTS through the engine (chunked prefill, a prefix hit from
    the radix cache, batched decode) with this attention backend."""
    from minisgl_mp.llm import LLM
    from minisgl_mp.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM(str(model_dir), attention_backend=backend, device=str(DEVICE), num_pages=256,
              max_running_requests=4, max_prefill_tokens=32)
    llm.generate(ENGINE_PROMPTS[:1], params)  # the second prompt then hits its prefix
    return [o["token_ids"] for o in llm.generate(ENGINE_PROMPTS, params)]


@pytest.fixture(scope="module")
def default_backend_tokens(tiny_model_dir) -> list[list[int]]:
    return engine_greedy(tiny_model_dir, "auto")


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_engine_greedy_tokens_match_the_default_backend(backend: str, tiny_model_dir, default_backend_tokens) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton not installed")
    assert engine_greedy(tiny_model_dir, backend) == default_backend_tokens


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_speculation_sends_a_verifications_rows_to_the_decode_kernels(tiny_model_dir) -> None:
    """With NGRAM and K drafts, the K + 1 rows of a verification go where decodes go: the Triton
    decode kernel (one-token queries), the C paged kernel (its short runs)."""
    from minisgl_mp.llm import LLM

    for backend, plain_max in (("triton", 1), ("cpu", 16)):
        if not registry.is_available(backend, DEVICE):
            continue
        for spec in ({}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 20}):
            llm = LLM(str(tiny_model_dir), attention_backend=backend, device=str(DEVICE), num_pages=64, **spec)
            assert llm.scheduler.runner.backend.max_query == (21 if spec else plain_max), (backend, spec)
            llm.shutdown()
