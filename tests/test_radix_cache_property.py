"""Property test: random insert/match/lock/unlock/evict sequences against a reference model.

The reference model maps every cached prefix that ends on a page boundary (a tuple of token
ids) to the KV locations of its last page. A ledger plays the scheduler's part: it allocates
locations, hands them to insert, takes back duplicates, tails and evicted ones, and fails if
any location is live twice.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl_mp.kvcache.base import BasePrefixCache, CacheHandle, create_prefix_cache

Tokens = tuple[int, ...]


class Model:
    """Every cached prefix that ends on a page boundary -> the KV locations of its last page."""

    def __init__(self, page_size: int, keeps: bool) -> None:
        self.page_size = page_size
        self.keeps = keeps
        self.pages: dict[Tokens, tuple[int, ...]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size

    def match_len(self, ids: Tokens) -> int:
        n = 0
        while n + self.page_size <= len(ids) and ids[: n + self.page_size] in self.pages:
            n += self.page_size
        return n

    def locations(self, ids: Tokens, n: int) -> list[int]:
        ps = self.page_size
        return [loc for end in range(ps, n + 1, ps) for loc in self.pages[ids[:end]]]

    def insert(self, ids: Tokens, indices: list[int]) -> None:
        ps = self.page_size
        if self.keeps:
            for end in range(ps, len(ids) + 1, ps):
                self.pages.setdefault(ids[:end], tuple(indices[end - ps : end]))

    def forget(self, freed: set[int]) -> None:
        gone = {k for k, v in self.pages.items() if freed.intersection(v)}
        assert all(freed.issuperset(self.pages[k]) for k in gone), "evict split a page"
        self.pages = {k: v for k, v in self.pages.items() if k not in gone}


class Ledger:
    """Who holds each KV location: the caller (a request), the tree, or nobody (free)."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.next_new = 0
        self.caller: set[int] = set()
        self.tree: set[int] = set()

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                loc = self.free.pop()
            else:
                loc, self.next_new = self.next_new, self.next_new + 1
            live = loc in self.caller or loc in self.tree
            assert not live, f"location {loc} handed out twice"
            self.caller.add(loc)
            out.append(loc)
        return out

    def release(self, locs: list[int], holder: set[int]) -> None:
        for loc in locs:
            assert loc in holder, f"location {loc} released by someone who does not hold it"
            holder.remove(loc)
            self.free.append(loc)

    def to_tree(self, locs: list[int]) -> None:
        for loc in locs:
            self.caller.remove(loc)
            assert loc not in self.tree, f"location {loc} given to the tree twice"
            self.tree.add(loc)


# A step: (op, token ids, a flag, a number that picks a handle or how many tokens to evict).
Step = tuple[str, Tokens, bool, int]

# Repeats weight the draw: matches (which lock and split) most, evictions least.
OPS = ("insert", "insert", "match", "match", "match", "unlock", "evict")
# Requests share long prefixes in practice, so token ids are a cut of one of a few fixed
# documents plus a short random tail: that makes deep matches, splits in the middle of nodes
# (also under locked handles) and mismatches in the middle of pages common. A tiny alphabet
# for the tail makes accidental sharing common too.
DOCUMENTS = [tuple(random.Random(seed).choices(range(3), k=24)) for seed in range(4)]
_STEP_CHOICES = len(OPS) * 2 * len(DOCUMENTS) * 25 * 256


def decode_step(code: int, tail: bytes) -> Step:
    """One integer and one short byte string per step: hypothesis's own cost is per choice it
    draws, so packing a step into two choices keeps the test fast. 0 decodes to a no-op."""
    code, op = divmod(code, len(OPS))
    code, flag = divmod(code, 2)
    code, doc = divmod(code, len(DOCUMENTS))
    pick, cut = divmod(code, 25)
    ids = DOCUMENTS[doc][:cut] + tuple(b % 3 for b in tail)
    return OPS[op], ids, bool(flag), pick


programs = st.lists(
    st.builds(decode_step, st.integers(0, _STEP_CHOICES - 1), st.binary(max_size=6)),
    min_size=10,  # long enough for locks, splits and evictions to interleave
    max_size=40,
)


def run_random_program(cache: BasePrefixCache, model: Model, program: list[Step]) -> None:
    ps = cache.page_size
    ledger = Ledger()
    locked: list[tuple[CacheHandle, Tokens, list[int]]] = []
    for op, ids, flag, pick in program:
        if op == "insert":
            # A request that matched just now (flag) reuses the tree's locations for its prefix;
            # one that matched long ago computed everything itself and now holds duplicates.
            prefix = model.match_len(ids) if flag else 0
            indices = model.locations(ids, prefix) + ledger.alloc(len(ids) - prefix)
            input_ids = torch.tensor(ids, dtype=torch.int64)
            result = cache.insert_prefix(input_ids, torch.tensor(indices, dtype=torch.int64))
            assert result.matched_len == model.match_len(ids)
            model.insert(ids, indices)
            kept = result.handle.prefix_len
            assert kept == model.match_len(ids)
            ledger.release(indices[prefix : result.matched_len], ledger.caller)
            ledger.to_tree(indices[max(prefix, result.matched_len) : kept])
            ledger.release(indices[max(prefix, kept) :], ledger.caller)
            assert result.handle.get_matched_indices().tolist() == model.locations(ids, kept)
        elif op == "match":
            handle = cache.match_prefix(torch.tensor(ids, dtype=torch.int64)).handle
            expected = model.locations(ids, model.match_len(ids))
            assert handle.get_matched_indices().tolist() == expected
            if flag:
                cache.lock(handle)
                locked.append((handle, ids, expected))
        elif op == "unlock" and locked:
            handle, _, _ = locked.pop(pick % len(locked))
            cache.unlock(handle)
        elif op == "evict":
            evictable = cache.size_info.evictable_tokens
            n = pick % (evictable + ps + 1)
            if n > evictable:
                with pytest.raises(ValueError, match=f"cannot evict {n} tokens: only {evictable}"):
                    cache.evict(n)
            else:
                freed = cache.evict(n).tolist()
                assert len(freed) >= n and len(set(freed)) == len(freed)
                ledger.release(freed, ledger.tree)
                model.forget(set(freed))
        cache.check_integrity()
        check_agrees(cache, model, ledger, locked)

    for handle, _, _ in locked:
        cache.unlock(handle)
    freed = cache.reset().tolist()
    ledger.release(freed, ledger.tree)
    assert not ledger.tree and cache.size_info.total_tokens == 0
    cache.check_integrity()


def check_agrees(
    cache: BasePrefixCache,
    model: Model,
    ledger: Ledger,
    locked: list[tuple[CacheHandle, Tokens, list[int]]],
) -> None:
    cached = [loc for page in model.pages.values() for loc in page]
    assert len(cached) == len(set(cached)), "a location is cached under two prefixes"
    assert set(cached) == ledger.tree
    ps = model.page_size
    held: set[Tokens] = set()
    for handle, ids, expected in locked:
        # A locked prefix is never evicted: its locations stay put.
        assert handle.get_matched_indices().tolist() == expected
        held.update(ids[:end] for end in range(ps, handle.prefix_len + 1, ps))
    info = cache.size_info
    assert info.protected_tokens == len(held) * ps
    assert info.evictable_tokens == model.num_tokens - len(held) * ps


@settings(max_examples=200, deadline=None, derandomize=True)
@given(page_size=st.sampled_from([1, 2, 4]), program=programs)
def test_radix_cache_matches_reference_model(page_size: int, program: list[Step]) -> None:
    cache = create_prefix_cache("radix", page_size, "cpu")
    run_random_program(cache, Model(page_size, keeps=True), program)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(page_size=st.sampled_from([1, 4]), program=programs)
def test_naive_cache_follows_the_same_api(page_size: int, program: list[Step]) -> None:
    cache = create_prefix_cache("naive", page_size, "cpu")
    run_random_program(cache, Model(page_size, keeps=False), program)
