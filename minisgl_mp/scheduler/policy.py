"""The order in which waiting requests are considered for admission."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from minisgl_mp.kvcache.base import BasePrefixCache
from minisgl_mp.kvcache.radix_cache import RadixPrefixCache
from minisgl_mp.scheduler.req import Req

# Matching every waiting request each round costs a tree walk each; past this many waiting
# requests longest-prefix-match falls back to arrival order (SGLang does the same).
LPM_MAX_QUEUE = 128


def order_waiting(waiting: Sequence[Req], policy: str, cache: BasePrefixCache, aging_steps: int,
                  now: int) -> Iterable[Req]:
    """fcfs: arrival order (retracted requests were put back at the front), `waiting` itself:
    admission stops at the first request that does not fit, so a long queue costs nothing
    beyond the requests looked at.
    lpm: requests that waited `aging_steps` rounds (`now` is the current round) first, in
    arrival order, so a cache-cold request is not starved by a stream of cache-hot ones; then
    longest cached prefix first."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return waiting
    aged = [r for r in waiting if now - r.wait_start_round >= aging_steps]
    fresh = [r for r in waiting if now - r.wait_start_round < aging_steps]

    def hit(r: Req) -> int:
        ids = torch.tensor(r.token_ids[: r.prefix_match_limit], dtype=torch.int64)
        return cache.match_prefix(ids).handle.prefix_len

    hits = {id(r): hit(r) for r in fresh}
    fresh.sort(key=lambda r: -hits[id(r)])  # stable: ties keep arrival order
    return aged + fresh


class InFlightPrefixes:
    """Prompts being prefilled now, whose KV is not in the prefix cache yet.

    Requests that arrive together with a shared opening (a system prompt) would each compute
    it. A waiting request that shares at least IN_BATCH_SHARE_TOKENS uncached tokens with one
    of these waits a round instead: once that prefill is cached, it computes only its own
    part (SGLang defers such requests the same way).
    """

    IN_BATCH_SHARE_TOKENS = 32

    def __init__(self, cache: BasePrefixCache) -> None:
        self.cache = cache
        self.tree = RadixPrefixCache(page_size=1, device="cpu")  # keys only; values are dummies
        self._next = 0

    def add(self, req: Req) -> None:
        ids = torch.tensor(req.token_ids, dtype=torch.int64)
        self.tree.insert_prefix(ids, torch.arange(self._next, self._next + len(ids)))
        self._next += len(ids)

    def should_wait(self, req: Req) -> bool:
        ids = torch.tensor(req.token_ids[: req.prefix_match_limit], dtype=torch.int64)
        shared = self.tree.match_prefix(ids).handle.prefix_len
        if shared < self.IN_BATCH_SHARE_TOKENS:
            return False
        return shared - self.cache.match_prefix(ids).handle.prefix_len >= self.IN_BATCH_SHARE_TOKENS
