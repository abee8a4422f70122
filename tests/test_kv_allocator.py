"""The KV page allocator, the page table's row allocator and the KV pool."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable

CPU = torch.device("cpu")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_come_in_whole_aligned_pages(page_size: int) -> None:
    alloc = PageAllocator(num_pages=10, page_size=page_size, device=CPU)
    slots = alloc.alloc_slots(3)
    assert slots is not None and slots.dtype == torch.int64 and slots.numel() == 3 * page_size
    runs = slots.view(3, page_size)
    assert (runs[:, 0] % page_size == 0).all(), "a page does not start at a page boundary"
    assert torch.equal(runs - runs[:, :1], torch.arange(page_size).expand(3, -1))
    assert len(set(runs[:, 0].tolist())) == 3
    assert slots.min() >= 0 and slots.max() < alloc.num_slots == 10 * page_size
    assert alloc.num_free_pages == 7


def test_runs_are_handed_out_ascending_and_come_back_in_order() -> None:
    # A request's KV along memory in order: the decode kernel's reads follow the prefetchers.
    alloc = PageAllocator(num_pages=64, page_size=1, device=CPU)
    first, second = alloc.alloc_slots(10), alloc.alloc_slots(20)
    assert first.tolist() == list(range(10)) and second.tolist() == list(range(10, 30))
    alloc.free_slots(second)
    assert alloc.alloc_slots(20).tolist() == list(range(10, 30))


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2, device=CPU)
    first = alloc.alloc_slots(3)
    assert alloc.alloc_pages(2) is None and alloc.alloc_slots(2) is None
    assert alloc.num_free_pages == 1
    last = alloc.alloc_slots(1)
    assert last is not None and not set(last.tolist()) & set(first.tolist())
    assert alloc.alloc_slots(1) is None
    assert alloc.alloc_pages(0).numel() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_freed_pages_are_handed_out_again(page_size: int) -> None:
    alloc = PageAllocator(num_pages=3, page_size=page_size, device=CPU)
    a, b, c = (alloc.alloc_slots(1) for _ in range(3))
    assert alloc.alloc_slots(1) is None
    alloc.free_slots(b)
    again = alloc.alloc_slots(1)
    assert torch.equal(again, b)
    alloc.free_slots(torch.cat([a, c, again]))
    assert alloc.num_free_pages == 3
    assert sorted(alloc.alloc_slots(3).tolist()) == list(range(3 * page_size))


def test_random_alloc_and_free_never_hands_out_a_page_twice() -> None:
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=64, page_size=4, device=CPU)
    held: list[torch.Tensor] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            alloc.free_slots(held.pop(rng.randrange(len(held))))
        else:
            slots = alloc.alloc_slots(rng.randint(1, 6))
            if slots is not None:
                held.append(slots)
        in_use = torch.cat(held).tolist() if held else []
        assert len(in_use) == len(set(in_use)), "a slot was handed out twice"
        assert alloc.num_free_pages * 4 + len(in_use) == alloc.num_slots


def test_double_free_past_the_pool_is_detected() -> None:
    alloc = PageAllocator(num_pages=4, page_size=4, device=CPU)
    slots = alloc.alloc_slots(2)
    alloc.free_slots(slots)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free_slots(slots)


def test_double_free_while_other_pages_are_in_use_is_detected() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1, device=CPU)
    a = alloc.alloc_slots(1)
    alloc.alloc_slots(1)
    alloc.free_slots(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free_slots(a)


def test_free_of_nothing_and_reset() -> None:
    alloc = PageAllocator(num_pages=5, page_size=2, device=CPU)
    alloc.alloc_slots(4)
    alloc.free_slots(torch.empty(0, dtype=torch.int64))
    assert alloc.num_free_pages == 1
    alloc.reset()
    assert alloc.num_free_pages == 5 and alloc.alloc_slots(5).numel() == 10


def test_req_table_rows() -> None:
    table = ReqTable(max_reqs=3, max_context_len=16, device=CPU)
    assert table.table.shape == (3, 16) and table.table.dtype == torch.int64
    rows = [table.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and table.num_free == 0
    assert table.alloc() is None
    table.free(rows[1])
    assert table.num_free == 1 and table.alloc() == rows[1]


def test_kv_pool_store_and_pad_slot() -> None:
    pool = KVPool(num_layers=2, num_slots=8, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=CPU)
    assert pool.k.shape == pool.v.shape == (2, 9, 2, 4) and pool.pad_slot == 8
    assert not pool.k[:, 8].any() and not pool.v[:, 8].any()
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loc = torch.tensor([5, 0, 7])
    pool.store(1, loc, k, v)
    assert torch.equal(pool.k[1, loc], k) and torch.equal(pool.v[1, loc], v)
    assert pool.nbytes == 2 * 2 * 9 * 2 * 4 * 4
    assert KVPool.bytes_per_token(2, 2, 4, torch.bfloat16) == 2 * 2 * 2 * 4 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_store_through_the_cpu_kernel_matches_index_copy(dtype: torch.dtype) -> None:
    """The C store (one call a layer on the CPU) writes what index_copy_ and torch's cast
    would, for V as a view into the fused qkv projection too, and leaves every other slot and
    layer alone; inputs it does not take (float16 K, a non-unit stride) go the PyTorch way."""
    from minisgl_mp.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the store has only its PyTorch path")
    pool = KVPool(num_layers=3, num_slots=40, num_kv_heads=2, head_dim=8, dtype=dtype, device=CPU, prefault=True)
    assert pool._kernel_store
    ref_k, ref_v = pool.k.clone(), pool.v.clone()
    qkv = torch.randn(5, 4 * 8 + 2 * 2 * 8) * 3
    qkv[0, -1] = float("nan")  # a NaN stays NaN in the bfloat16 cast
    k = torch.randn(5, 2, 8)
    v = qkv[:, 4 * 8 + 2 * 8:].reshape(5, 2, 8)  # rows 64 floats apart
    loc = torch.tensor([33, 2, 17, 0, 39])
    pool.store(1, loc, k, v)
    ref_k[1].index_copy_(0, loc, k.to(dtype))
    ref_v[1].index_copy_(0, loc, v.to(dtype))
    assert torch.equal(pool.k, ref_k) and torch.equal(pool.v[..., :-1], ref_v[..., :-1])
    assert torch.equal(pool.v.isnan(), ref_v.isnan())
    half = torch.randn(2, 2, 8).half()
    strided = torch.randn(2, 8, 2).transpose(1, 2)
    pool.store(2, torch.tensor([3, 4]), half, strided)
    assert torch.equal(pool.k[2, 3:5], half.to(dtype)) and torch.equal(pool.v[2, 3:5], strided.to(dtype))


def test_a_prefaulted_pool_is_written_through_and_still_works() -> None:
    pool = KVPool(num_layers=2, num_slots=8, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=CPU,
                  prefault=True)
    assert not pool.k.any() and not pool.v.any() and pool.pad_slot == 8
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.store(0, torch.tensor([1, 6]), k, v)
    assert torch.equal(pool.k[0, 6], k[1]) and not pool.k[:, 8].any()


def test_the_engine_prefaults_its_pool_when_asked(tiny_model_dir) -> None:
    from minisgl_mp import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_pages=256, cpu_prefault_kv=True)
    pool = llm.scheduler.runner.pool
    assert pool.num_slots == 256
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0]["token_ids"]) == 4
