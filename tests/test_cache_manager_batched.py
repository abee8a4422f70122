"""CacheManager.reserve_decodes: one allocation and one page-table store for a whole decode
batch must leave exactly what per-request `reserve(r, 1)` calls leave: the same slots, the
same table, the same free pages; and refuse cleanly when the pool is short."""

from __future__ import annotations

import pytest
import torch

from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.kvcache.radix_cache import RadixPrefixCache
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.cache_manager import CacheManager
from minisgl_mp.scheduler.req import Req

CPU = torch.device("cpu")


def manager_with_requests(page_size: int, prompt_lens: list[int], num_pages: int) -> tuple[CacheManager, list[Req]]:
    kv = CacheManager(PageAllocator(num_pages, page_size, CPU), RadixPrefixCache(page_size, CPU),
                      ReqTable(len(prompt_lens), 256, CPU))
    reqs = []
    for i, n in enumerate(prompt_lens):
        req = Req(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(), 256, frozenset())
        assert kv.admit(req)
        assert kv.reserve(req, n) is not None  # the prompt's slots; then it is "computed"
        req.computed_len = n
        reqs.append(req)
    return kv, reqs


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batched_decode_reservation_matches_one_by_one(page_size: int) -> None:
    lens = [3, 4, 16, 17, 1]  # some end exactly on a page boundary, some mid-page
    a, reqs_a = manager_with_requests(page_size, lens, 64)
    b, reqs_b = manager_with_requests(page_size, lens, 64)
    for step in range(page_size + 2):  # crosses a page boundary for every request
        one_by_one = torch.stack([a.reserve(r, 1)[0] for r in reqs_a])
        batched = b.reserve_decodes(reqs_b)
        assert batched is not None and torch.equal(batched, one_by_one), f"step {step}"
        for ra, rb in zip(reqs_a, reqs_b):
            ra.computed_len += 1
            rb.computed_len += 1
            assert ra.alloc_len == rb.alloc_len
        assert torch.equal(a.table.table, b.table.table)
        assert a.allocator.num_free_pages == b.allocator.num_free_pages


def test_batched_decode_reservation_refuses_when_the_pool_is_short() -> None:
    kv, reqs = manager_with_requests(4, [4, 8], 3)  # 3 pages, all in use, both requests need one more
    before = (kv.table.table.clone(), kv.allocator.num_free_pages, [r.alloc_len for r in reqs])
    assert kv.reserve_decodes(reqs) is None
    assert torch.equal(kv.table.table, before[0]) and kv.allocator.num_free_pages == before[1]
    assert [r.alloc_len for r in reqs] == before[2]
    assert kv.reserve_decodes([]).numel() == 0
