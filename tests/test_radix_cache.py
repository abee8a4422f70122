"""Unit tests for the prefix caches: the radix tree's match/insert/lock/evict rules and the factory.

Every radix test runs at page sizes 1, 4 and 16; "page p" below means the page_size tokens
[p*100, p*100+1, ...], located at [p*1000, p*1000+1, ...] unless a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch

from minisgl_mp.kvcache.base import (
    CacheIntegrityError,
    SizeInfo,
    create_prefix_cache,
)
from minisgl_mp.kvcache.naive_cache import NaiveCache
from minisgl_mp.kvcache.radix_cache import RadixPrefixCache

PAGE_SIZES = [1, 4, 16]


def pages(ps: int, *ids: int) -> torch.Tensor:
    """Token ids for a run of pages."""
    return torch.tensor([i * 100 + j for i in ids for j in range(ps)], dtype=torch.int64)


def locs(ps: int, *ids: int) -> torch.Tensor:
    """KV locations for a run of pages."""
    return torch.tensor([i * 1000 + j for i in ids for j in range(ps)], dtype=torch.int64)


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def ps(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def cache(ps: int) -> RadixPrefixCache:
    return RadixPrefixCache(page_size=ps, device="cpu")


def insert(cache: RadixPrefixCache, *ids: int, at: tuple[int, ...] | None = None):
    ps = cache.page_size
    result = cache.insert_prefix(pages(ps, *ids), locs(ps, *(at or ids)))
    cache.check_integrity()
    return result


def test_worked_example(cache: RadixPrefixCache, ps: int) -> None:
    insert(cache, 5, 6, 7, at=(50, 51, 52))
    second = insert(cache, 5, 6, 8, 9, at=(50, 51, 60, 61))
    assert second.matched_len == 2 * ps
    assert torch.equal(second.handle.get_matched_indices(), locs(ps, 50, 51, 60, 61))

    match = cache.match_prefix(pages(ps, 5, 6, 8, 4))
    cache.check_integrity()
    assert match.handle.prefix_len == 3 * ps
    assert torch.equal(match.handle.get_matched_indices(), locs(ps, 50, 51, 60))
    assert cache.size_info.total_tokens == 5 * ps  # the split added and removed nothing

    cache.lock(match.handle)
    # Protected: [5,6] and [8] (split off [9]); evictable: [7] and [9].
    assert cache.size_info == SizeInfo(evictable_tokens=2 * ps, protected_tokens=3 * ps)
    assert torch.equal(cache.evict(1), locs(ps, 52))  # [7] was used least recently
    assert torch.equal(cache.evict(1), locs(ps, 61))
    cache.check_integrity()
    assert cache.size_info == SizeInfo(0, 3 * ps)


def test_match_rounds_down_to_whole_pages(cache: RadixPrefixCache, ps: int) -> None:
    insert(cache, 1, 2, 3)
    query = torch.cat([pages(ps, 1, 2, 3), pages(ps, 9)[: ps - 1]])
    assert cache.match_prefix(query).handle.prefix_len == 3 * ps
    if ps > 1:
        # The third page is cached, but only part of it is asked for: it cannot be used.
        assert cache.match_prefix(pages(ps, 1, 2, 3)[: 3 * ps - 1]).handle.prefix_len == 2 * ps


@pytest.mark.parametrize("ps", [4, 16])  # a page of one token cannot differ partway
def test_match_partway_into_a_page_stops_at_the_page_before(ps: int) -> None:
    cache = RadixPrefixCache(page_size=ps, device="cpu")
    insert(cache, 1, 2, 3)
    query = pages(ps, 1, 2, 3).clone()
    query[2 * ps + ps // 2] = -1  # differs in the middle of the third page
    match = cache.match_prefix(query)
    cache.check_integrity()
    assert match.handle.prefix_len == 2 * ps
    assert torch.equal(match.handle.get_matched_indices(), locs(ps, 1, 2))


def test_insert_caches_whole_pages_only() -> None:
    cache = RadixPrefixCache(page_size=16, device="cpu")
    result = cache.insert_prefix(torch.arange(30), torch.arange(100, 130))
    cache.check_integrity()
    assert result.matched_len == 0
    assert result.handle.prefix_len == 16
    assert torch.equal(result.handle.get_matched_indices(), torch.arange(100, 116))
    assert cache.size_info == SizeInfo(16, 0)
    assert cache.match_prefix(torch.arange(30)).handle.prefix_len == 16


def test_insert_reports_what_was_cached_and_keeps_the_trees_locations(
    cache: RadixPrefixCache, ps: int
) -> None:
    insert(cache, 1, 2)
    # A second request computed the same prefix at its own locations, plus one new page.
    result = insert(cache, 1, 2, 3, at=(71, 72, 73))
    assert result.matched_len == 2 * ps  # so the caller frees locs 71, 72 itself
    assert torch.equal(result.handle.get_matched_indices(), locs(ps, 1, 2, 73))
    assert cache.size_info.total_tokens == 3 * ps


def test_insert_of_a_fully_cached_prefix_adds_nothing(cache: RadixPrefixCache, ps: int) -> None:
    insert(cache, 1, 2, 3)
    result = insert(cache, 1, 2, at=(81, 82))
    assert result.matched_len == result.handle.prefix_len == 2 * ps
    assert torch.equal(result.handle.get_matched_indices(), locs(ps, 1, 2))
    assert cache.size_info.total_tokens == 3 * ps


def test_insert_rejects_mismatched_lengths(cache: RadixPrefixCache, ps: int) -> None:
    with pytest.raises(ValueError, match="indices has"):
        cache.insert_prefix(pages(ps, 1, 2), locs(ps, 1))
    with pytest.raises(ValueError, match="1-D"):
        cache.match_prefix(pages(ps, 1, 2).view(1, -1))


def test_insert_copies_locations(cache: RadixPrefixCache, ps: int) -> None:
    indices = locs(ps, 1, 2)
    cache.insert_prefix(pages(ps, 1, 2), indices)
    indices.fill_(-1)  # the caller reuses its table row
    matched = cache.match_prefix(pages(ps, 1, 2)).handle.get_matched_indices()
    assert torch.equal(matched, locs(ps, 1, 2))


def test_empty_and_sub_page_inputs(cache: RadixPrefixCache, ps: int) -> None:
    empty = torch.empty(0, dtype=torch.int64)
    for ids in (empty, pages(ps, 1)[: ps - 1]):
        match = cache.match_prefix(ids)
        assert match.handle.prefix_len == 0
        assert match.handle.get_matched_indices().tolist() == []
        result = cache.insert_prefix(ids, torch.arange(len(ids)))
        assert (result.matched_len, result.handle.prefix_len) == (0, 0)
        cache.lock(result.handle)
        cache.unlock(result.handle)
    cache.check_integrity()
    assert cache.size_info == SizeInfo(0, 0)
    assert cache.evict(0).tolist() == []


def test_split_keeps_locked_handles_valid(cache: RadixPrefixCache, ps: int) -> None:
    handle = insert(cache, 1, 2, 3, 4).handle
    cache.lock(handle)
    cache.match_prefix(pages(ps, 1, 2, 9))  # splits [1,2,3,4] under the locked handle
    cache.check_integrity()
    assert torch.equal(handle.get_matched_indices(), locs(ps, 1, 2, 3, 4))
    assert cache.size_info == SizeInfo(0, 4 * ps)
    cache.unlock(handle)
    assert cache.size_info == SizeInfo(4 * ps, 0)
    cache.check_integrity()


def test_lock_counts_references(cache: RadixPrefixCache, ps: int) -> None:
    short = insert(cache, 1, 2).handle
    long = insert(cache, 1, 2, 3).handle
    cache.lock(long)
    cache.lock(short)
    cache.unlock(long)
    cache.check_integrity()
    assert cache.size_info == SizeInfo(ps, 2 * ps)  # [3] is free again, [1,2] is still held
    cache.unlock(short)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(short)
    cache.check_integrity()
    assert cache.size_info == SizeInfo(3 * ps, 0)


def test_empty_handle_lock_is_a_no_op(cache: RadixPrefixCache) -> None:
    insert(cache, 1)
    handle = cache.empty_handle()
    assert handle.prefix_len == 0 and handle.get_matched_indices().tolist() == []
    cache.lock(handle)
    cache.unlock(handle)
    cache.unlock(handle)
    assert cache.size_info.protected_tokens == 0


def test_evict_is_lru_and_match_refreshes(cache: RadixPrefixCache, ps: int) -> None:
    insert(cache, 1)
    insert(cache, 2)
    insert(cache, 3)
    cache.match_prefix(pages(ps, 1))  # 1 becomes the most recently used
    order = [cache.evict(1) for _ in range(3)]
    assert [o.tolist() for o in order] == [locs(ps, i).tolist() for i in (2, 3, 1)]


def test_evict_frees_whole_nodes_and_parents_follow(cache: RadixPrefixCache, ps: int) -> None:
    insert(cache, 1, 2)
    insert(cache, 1, 2, 3, 4)
    freed = cache.evict(1)  # the leaf [3,4] goes as a whole
    assert freed.tolist() == locs(ps, 3, 4).tolist()
    freed = cache.evict(1)  # then [1,2], now an unreferenced leaf
    assert freed.tolist() == locs(ps, 1, 2).tolist()
    cache.check_integrity()
    assert cache.size_info == SizeInfo(0, 0)
    assert cache.match_prefix(pages(ps, 1, 2)).handle.prefix_len == 0


def test_evict_never_frees_protected_tokens(cache: RadixPrefixCache, ps: int) -> None:
    held = insert(cache, 1, 2).handle
    insert(cache, 1, 3)
    insert(cache, 4)
    cache.lock(held)
    with pytest.raises(ValueError, match=f"cannot evict {3 * ps} tokens: only {2 * ps} are"):
        cache.evict(3 * ps)
    freed = cache.evict(2 * ps)
    assert sorted(freed.tolist()) == sorted(locs(ps, 3, 4).tolist())
    assert torch.equal(held.get_matched_indices(), locs(ps, 1, 2))
    cache.check_integrity()


def test_handle_of_an_evicted_prefix_is_stale(cache: RadixPrefixCache) -> None:
    handle = insert(cache, 1).handle
    cache.evict(1)
    with pytest.raises(ValueError, match="stale"):
        cache.lock(handle)
    with pytest.raises(ValueError, match="stale"):
        handle.get_matched_indices()


def test_foreign_handle_is_rejected(cache: RadixPrefixCache) -> None:
    other = RadixPrefixCache(page_size=cache.page_size, device="cpu")
    with pytest.raises(ValueError, match="not made by this cache"):
        cache.lock(other.empty_handle())


def test_reset_returns_everything_and_refuses_while_locked(
    cache: RadixPrefixCache, ps: int
) -> None:
    handle = insert(cache, 1, 2).handle
    insert(cache, 1, 3)
    cache.lock(handle)
    with pytest.raises(RuntimeError, match=f"{2 * ps} tokens are locked"):
        cache.reset()
    cache.unlock(handle)
    freed = cache.reset()
    assert sorted(freed.tolist()) == sorted(locs(ps, 1, 2, 3).tolist())
    assert cache.size_info == SizeInfo(0, 0)
    assert cache.match_prefix(pages(ps, 1, 2)).handle.prefix_len == 0
    with pytest.raises(ValueError, match="stale"):
        cache.lock(handle)
    cache.lock(cache.empty_handle())  # handles to the root survive a reset
    cache.check_integrity()


def test_values_are_int64_on_the_device(cache: RadixPrefixCache, ps: int) -> None:
    cache.insert_prefix(pages(ps, 1), locs(ps, 1).to(torch.int32))
    indices = cache.match_prefix(pages(ps, 1)).handle.get_matched_indices()
    assert indices.dtype == torch.int64 and indices.device == torch.device("cpu")
    assert cache.evict(1).dtype == torch.int64


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda c: setattr(c, "_evictable_tokens", c._evictable_tokens + 1), "recount"),
        (lambda c: c._evictable_leaves.clear(), "evictable-leaf set"),
        (lambda c: c._lru_heap.clear(), "LRU heap"),
        (lambda c: setattr(_first_leaf(c), "ref_count", 5), "more than its parent"),
        (lambda c: setattr(_first_leaf(c), "value", _first_leaf(c).value[:-1]), "expected int64"),
        (lambda c: setattr(_first_leaf(c), "value", _first_leaf(c).value + 1000), "more than once"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:
    cache = RadixPrefixCache(page_size=4, device="cpu")
    insert(cache, 1, 2)
    insert(cache, 1, 3)
    corrupt(cache)
    with pytest.raises(CacheIntegrityError, match=message):
        cache.check_integrity()


def _key(cache: RadixPrefixCache, page: int) -> tuple[int, ...]:
    return tuple(pages(cache.page_size, page).tolist())


def _first_leaf(cache: RadixPrefixCache):
    return cache._root.children[_key(cache, 1)].children[_key(cache, 2)]


def test_naive_cache_keeps_nothing() -> None:
    cache = NaiveCache(page_size=4, device="cpu")
    result = cache.insert_prefix(torch.arange(8), torch.arange(8))
    assert (result.matched_len, result.handle.prefix_len) == (0, 0)
    match = cache.match_prefix(torch.arange(8))
    assert match.handle.prefix_len == 0 and match.handle.get_matched_indices().tolist() == []
    cache.lock(match.handle)
    cache.unlock(match.handle)
    assert cache.size_info == SizeInfo(0, 0)
    assert cache.evict(0).tolist() == [] and cache.reset().tolist() == []
    with pytest.raises(ValueError, match="cannot evict 1 tokens: only 0"):
        cache.evict(1)
    with pytest.raises(ValueError, match="indices has"):
        cache.insert_prefix(torch.arange(8), torch.arange(7))
    cache.check_integrity()


def test_factory_chooses_by_name() -> None:
    assert isinstance(create_prefix_cache("radix", 4, "cpu"), RadixPrefixCache)
    naive = create_prefix_cache("naive", 4, "cpu")
    assert isinstance(naive, NaiveCache) and naive.page_size == 4
    with pytest.raises(ValueError, match="valid types: radix, naive"):
        create_prefix_cache("lru", 4, "cpu")
    with pytest.raises(ValueError, match="page_size"):
        create_prefix_cache("radix", 0, "cpu")
