"""Data parallelism on one machine (`--dp-size N`): which scheduler replica gets a request.

Each replica has its own KV pool and radix cache, so a request is worth most where its prompt's
prefix is already cached. The dispatcher cannot see the replicas' caches; like sglang-router's
cache_aware policy it keeps its own approximate index of what it sent where, and counts each
replica's requests in flight:

    replica = longest indexed prefix of the prompt; ties (and no match at all) -> fewest in flight,
              then the smallest index (spreads new prefixes over the caches, as the router does)
    unless that replica is overloaded against the least-loaded one -> fewest in flight

With one replica every request goes to it and nothing is indexed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from minisgl_mp.message.messages import AbortReq, GenerateReq

# The index hashes prompts in blocks of this many tokens: a shared prefix shorter than one block
# does not count (the scheduler would reuse it, but it is too short to be worth a lopsided load).
BLOCK_TOKENS = 16
# Per replica, the index remembers this many blocks (least recently dispatched forgotten first):
# about what a replica's cache can hold, so the index forgets roughly as the cache evicts.
MAX_BLOCKS_PER_REPLICA = 1 << 16
# sglang-router's load guard: the prefix choice is overruled when that replica has more than
# BALANCE_ABS more requests in flight than the least-loaded one and over BALANCE_REL times as
# many. The router's defaults are 64 and 1.5; a CPU replica saturates sooner, hence 16.
BALANCE_ABS = 16
BALANCE_REL = 1.5


class Queue(Protocol):
    def put(self, msg: Any) -> Awaitable[None]: ...


class PrefixIndex:
    """Which prompt prefixes one replica has been sent, as a chain of block hashes: the key of
    block i hashes block i's tokens with the key of block i-1, so a key names a whole prefix
    (a node of a token trie) in O(1) space. Bounded, least recently used first out."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def keys(ids: Sequence[int]) -> list[int]:
        keys, prev = [], 0
        for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            prev = hash((prev, tuple(ids[start:start + BLOCK_TOKENS])))
            keys.append(prev)
        return keys

    def match_blocks(self, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for k in keys:
            self._blocks[k] = None
            self._blocks.move_to_end(k)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class ReplicaDispatcher:
    """The tokenizer process's side of the scheduler replicas: sends each request to one
    replica, and its abort to the same one. `release(rid)` must be called once a request is
    over, whatever ended it."""

    def __init__(self, queues: Sequence[Queue], max_blocks: int = MAX_BLOCKS_PER_REPLICA) -> None:
        if not queues:
            raise ValueError("at least one scheduler queue is needed")
        self.queues = list(queues)
        self.indexes = [PrefixIndex(max_blocks) for _ in queues]
        self.in_flight = [0] * len(queues)
        self.owner: dict[str, int] = {}  # rid -> replica, while the request lives

    @property
    def size(self) -> int:
        return len(self.queues)

    def choose(self, ids: Sequence[int]) -> int:
        """The replica for a prompt (and remember that it went there)."""
        if self.size == 1:
            return 0
        keys = PrefixIndex.keys(ids)
        matched = [index.match_blocks(keys) for index in self.indexes]
        least = min(self.in_flight)
        # Longest prefix first, then fewest in flight, then the least indexed, then the lowest rank.
        best = min(range(self.size), key=lambda r: (-matched[r], self.in_flight[r], len(self.indexes[r]), r))
        load = self.in_flight[best]
        if load - least > BALANCE_ABS and load > least * BALANCE_REL:
            best = min(range(self.size), key=lambda r: (self.in_flight[r], -matched[r], r))
        self.indexes[best].insert(keys)
        return best

    async def submit(self, req: GenerateReq) -> int:
        rank = self.choose(req.input_ids)
        self.owner[req.rid] = rank
        self.in_flight[rank] += 1
        await self.queues[rank].put(req)
        return rank

    async def abort(self, rid: str) -> None:
        rank = self.owner.get(rid)
        if rank is not None:
            await self.queues[rank].put(AbortReq(rid))

    def release(self, rid: str) -> int | None:
        """The request is over: it no longer counts against its replica. Returns the replica
        it was on (None if it never reached one)."""
        rank = self.owner.pop(rid, None)
        if rank is not None:
            self.in_flight[rank] -= 1
        return rank

    async def send(self, rank: int, msg: Any) -> None:
        await self.queues[rank].put(msg)

    def forget_prefixes(self) -> None:
        """After /flush_cache: no replica holds a prefix any more."""
        for index in self.indexes:
            index.clear()
