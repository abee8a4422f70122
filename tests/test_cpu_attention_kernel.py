"""The C paged-attention kernels against PyTorch's scaled_dot_product_attention: decodes and
short extends over scattered pool slots, grouped-query shapes, bad inputs; and the blocked
kernel for long query runs (csrc/extend_attention.c) on every vector path this machine builds.
(The backend around them is tested against sdpa in test_attention_backends.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl_mp.kernels import cpu as cpu_kernel
from minisgl_mp.attention.cpu import KERNEL_MAX_QUERY
from attention_cases import ragged_batch

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel cannot be built")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, q_len: int) -> torch.Tensor:
    """q: [n, Hq, D] for the last n of len(slots) positions -> [n, Hq, D]."""
    n_kv = len(slots)
    ks, vs = k[slots].transpose(0, 1), v[slots].transpose(0, 1)
    first = n_kv - q_len
    mask = torch.arange(n_kv)[None, :] <= (first + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


# key_splits: None is the default (split only when requests are fewer than 2 x threads); the
# others force a request's key blocks (128 keys each) into that many runs merged afterwards.
@pytest.mark.parametrize("key_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 128), (16, 8, 128), (6, 1, 32)])
def test_kernel_matches_sdpa(hq: int, hkv: int, d: int, key_splits: int | None) -> None:
    q_lens = [1, 1, 4, KERNEL_MAX_QUERY, 1, 7]
    kv_lens = [1, 300, 4, KERNEL_MAX_QUERY + 40, 17, 700]
    q, k, v, kv_index, q_start, _, _ = ragged_batch(hq, hkv, d, q_lens, kv_lens, 5000, hq * 100 + d, 3.0,
                                                    stride=max(kv_lens) + 5)  # q * 3: peaky softmax too
    out = torch.full_like(q, float("nan"))
    cpu_kernel.paged_attention(q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), out, d**-0.5,
                               key_splits)
    for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(int(q_start[b]), int(q_start[b]) + nq)
        torch.testing.assert_close(out[rows], reference(q[rows], k, v, kv_index[b, :nk], nq), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_len,q_len", [(kv, q) for kv in (1, 64, 130, 257, 1500)
                                           for q in (1, 5, KERNEL_MAX_QUERY) if q <= kv])
def test_one_request_split_over_its_keys_matches_sdpa(kv_len: int, q_len: int) -> None:
    """One request (a batch-1 decode or an extend) is split over the threads by runs of key
    blocks, each block's partial softmax merged afterwards: every run size and edge must match,
    including blocks that an extend's early rows see none of."""
    hq, hkv, d = 16, 8, 128
    gen = torch.Generator().manual_seed(kv_len * 7 + q_len)
    k = torch.randn(2000, hkv, d, generator=gen)
    v = torch.randn(2000, hkv, d, generator=gen)
    kv_index = torch.randperm(2000, generator=gen)[:kv_len][None]
    q = torch.randn(q_len, hq, d, generator=gen) * 3
    want = reference(q, k, v, kv_index[0], q_len)
    for splits in (None, 2, 4, 7):
        out = torch.full_like(q, float("nan"))
        cpu_kernel.paged_attention(q, k, v, kv_index, torch.tensor([0]), torch.tensor([q_len]),
                                   torch.tensor([kv_len]), out, d**-0.5, splits)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("key_splits", [None, 4])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (6, 1, 40)])
def test_kernel_reads_a_bfloat16_pool_like_sdpa_on_the_widened_values(hq: int, hkv: int, d: int,
                                                                       key_splits: int | None) -> None:
    """With --kv-cache-dtype bfloat16 the kernel widens K/V on load: it must agree with float32
    attention over the same (bfloat16-rounded) values, on the vector path and the scalar one."""
    q_lens, kv_lens = [1, 1, 5, 1], [1, 257, 90, 33]
    q, k, v, kv_index, q_start, _, _ = ragged_batch(hq, hkv, d, q_lens, kv_lens, 3000, 7, 3.0, stride=300,
                                                    kv_dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    cpu_kernel.paged_attention(q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), out, d**-0.5,
                               key_splits)
    for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(int(q_start[b]), int(q_start[b]) + nq)
        want = reference(q[rows], k.float(), v.float(), kv_index[b, :nk], nq)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (6, 2, 48), (8, 8, 96), (4, 1, 256), (6, 2, 40)])
def test_decode_kernel_on_every_vector_path(isa: str, kv_dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    """Decodes take keys in chunks, kv head by kv head, each head's query rows accumulating their
    values in registers, in runs of the most vectors that divide the head dim: every build this
    machine makes must match sdpa for head dims of 1-16 vectors and one that is no whole number
    of them (40: the per-key path), query groups in pairs and odd ones (6 / 2: three a head),
    and contexts ending inside a chunk, at a key block (128) and past one; extends beside them."""
    if cpu_kernel.load(isa) is None:
        pytest.skip("no C compiler: the kernels are not built here")
    q_lens = [1, 1, 1, 1, 1, 3, 1]
    kv_lens = [1, 5, 16, 37, 256, 70, 600]
    q, k, v, kv_index, q_start, _, _ = ragged_batch(hq, hkv, d, q_lens, kv_lens, 3000, hq * 1000 + d, 3.0,
                                                    kv_dtype=kv_dtype)
    for key_splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        cpu_kernel.paged_attention(q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), out,
                                   d**-0.5, key_splits, isa=isa)
        for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
            rows = slice(int(q_start[b]), int(q_start[b]) + nq)
            want = reference(q[rows], k.float(), v.float(), kv_index[b, :nk], nq)
            torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 8, 128), (6, 2, 40)])
def test_a_row_gives_the_same_bits_however_it_is_batched(isa: str, kv_dtype: torch.dtype, hq: int, hkv: int,
                                                          d: int) -> None:
    """Speculative decoding checks a request's drafts as one extend of K + 1 query rows, and its
    greedy answers must be those of decoding token by token: wherever two logits nearly tie, a
    last-bit difference picks another token. So each query row of an extend must give exactly
    (bit for bit) what the same row decoded alone gives, whatever else is in the batch and
    however the call splits requests over threads: extends that cross a key block (128), end on
    one, or start inside the first chunk, against every row decoded by itself and in a batch."""
    if cpu_kernel.load(isa) is None:
        pytest.skip("no C compiler: the kernels are not built here")
    q_lens = [5, 12, 9, 3, 16]
    kv_lens = [131, 134, 256, 3, 700]  # rows at positions 126..130, 122..133, 247..255, 0..2, 684..699
    q, k, v, kv_index, q_start, ql, kl = ragged_batch(hq, hkv, d, q_lens, kv_lens, 2000, hq * 100 + d, 3.0,
                                                      kv_dtype=kv_dtype)
    scale = d**-0.5
    extended = []
    for key_splits in (1, 2, 4):
        out = torch.empty_like(q)
        cpu_kernel.paged_attention(q, k, v, kv_index, q_start, ql, kl, out, scale, key_splits, isa=isa)
        extended.append(out)
    assert all(torch.equal(extended[0], o) for o in extended[1:])
    # every row decoded alone (split or not), then all of them as one batch of decodes
    rows = [(b, i) for b, nq in enumerate(q_lens) for i in range(nq)]
    for b, i in rows:
        r = int(q_start[b]) + i
        pos = kv_lens[b] - q_lens[b] + i
        for key_splits in (1, 4):
            alone = torch.empty(1, hq, d)
            cpu_kernel.paged_attention(q[r:r + 1].contiguous(), k, v, kv_index[b:b + 1].contiguous(),
                                       torch.tensor([0]), torch.tensor([1]), torch.tensor([pos + 1]), alone, scale,
                                       key_splits, isa=isa)
            assert torch.equal(alone[0], extended[0][r]), (b, i, key_splits)
    idx = torch.tensor([int(q_start[b]) + i for b, i in rows])
    decodes = torch.empty(len(rows), hq, d)
    cpu_kernel.paged_attention(q[idx].contiguous(), k, v, kv_index[[b for b, _ in rows]].contiguous(),
                               torch.arange(len(rows)), torch.ones(len(rows), dtype=torch.int64),
                               torch.tensor([kv_lens[b] - q_lens[b] + i + 1 for b, i in rows]), decodes, scale,
                               isa=isa)
    assert torch.equal(decodes, extended[0][idx])


def test_bad_inputs_are_refused() -> None:
    q = torch.zeros(1, 2, 8)
    k = torch.zeros(4, 2, 8)
    idx = torch.zeros(1, 4, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel.paged_attention(q.double(), k, k, idx, one - 1, one, one, q, 1.0)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernel.paged_attention(q, k, k, idx.int(), one - 1, one, one, q, 1.0)
    with pytest.raises(ValueError, match="k and v alike"):
        cpu_kernel.paged_attention(q, k, k.bfloat16(), idx, one - 1, one, one, q, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernel.paged_attention(q, k.half(), k.half(), idx, one - 1, one, one, q, 1.0)


def test_long_context_decode_beside_an_extend_in_bounded_scratch() -> None:
    """Keys go through the kernel in blocks with partials merged in order: a decode over a long context
    beside a full-length extend must match SDPA, with a scratch sized by query rows only (it
    used to be rows x the longest context: ~335 MB for a 128-token extend beside a 40k decode)."""
    hq, hkv, d = 4, 2, 32
    q_lens = [1, 128, 1, 3]  # 128: the most the kernel is built for
    kv_lens = [20_000, 128 + 300, 257, 513]  # past block edges (256, 512)
    # q * 4: peaky, the running max moves
    q, k, v, kv_index, q_start, _, _ = ragged_batch(hq, hkv, d, q_lens, kv_lens, 24_000, 11, 4.0)
    out = torch.full_like(q, float("nan"))
    cpu_kernel.paged_attention(q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), out, d**-0.5,
                               key_splits=4)
    for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(int(q_start[b]), int(q_start[b]) + nq)
        torch.testing.assert_close(out[rows], reference(q[rows], k, v, kv_index[b, :nk], nq), atol=2e-5, rtol=1e-4)


def _isas() -> list[str]:
    isas = ["avx2", "scalar"]
    if cpu_kernel.kernel_isa("native") == 512:
        isas.insert(0, "native")
    return isas


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (8, 2, 64), (4, 4, 32), (6, 1, 96)])
def test_extend_kernel_matches_sdpa(isa: str, hq: int, hkv: int, d: int) -> None:
    """Prompts and extends over a cached prefix, in one batch over scattered slots: lengths
    around the kernel's query blocks (64) and key tiles (32 / 48), a one-token run, a prefix
    longer than the run, and peaky scores (the running max moves between tiles)."""
    if cpu_kernel.load(isa) is None:
        pytest.skip("no C compiler: the kernels are not built here")
    cached = [0, 0, 0, 5, 300, 0, 1000, 47]
    q_lens = [17, 64, 65, 100, 40, 1, 129, 200]
    kv_lens = [c + n for c, n in zip(cached, q_lens)]
    q, k, v, kv_index, q_start, _, _ = ragged_batch(hq, hkv, d, q_lens, kv_lens, 4000, hq * 10 + d, 3.0,
                                                    stride=max(kv_lens) + 3)
    out = torch.full_like(q, float("nan"))
    cpu_kernel.extend_attention(q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), out,
                                d**-0.5, isa=isa)
    for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(int(q_start[b]), int(q_start[b]) + nq)
        torch.testing.assert_close(out[rows], reference(q[rows], k, v, kv_index[b, :nk], nq), atol=2e-5, rtol=1e-4)


def test_extend_kernel_refuses_what_it_cannot_take() -> None:
    one = torch.ones(1, dtype=torch.int64)
    idx = torch.zeros(1, 4, dtype=torch.int64)
    q = torch.zeros(1, 2, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernel.extend_attention(q, torch.zeros(4, 2, 40), torch.zeros(4, 2, 40), idx, one - 1, one, one, q, 1.0)
    q = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match="float32"):
        kv = torch.zeros(4, 2, 32).bfloat16()
        cpu_kernel.extend_attention(q, kv, kv, idx, one - 1, one, one, q, 1.0)
