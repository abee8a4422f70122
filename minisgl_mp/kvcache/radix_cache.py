"""A radix tree of cached token prefixes, with LRU eviction that never walks the whole tree."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Union

import torch

from minisgl_mp.kvcache.base import (
    BasePrefixCache,
    CacheHandle,
    CacheIntegrityError,
    InsertResult,
    MatchResult,
    SizeInfo,
    check_input_ids,
    check_insert_args,
    check_page_size,
)

# A child is found by its first token (page_size 1) or by the tuple of its first page's tokens.
ChildKey = Union[int, tuple[int, ...]]


class _Node:
    """A run of tokens with no branching. key: token ids (CPU tuple); value: int64 [len(key)]
    KV locations on the cache's device. The root has an empty key and is never referenced."""

    __slots__ = ("key", "value", "parent", "children", "ref_count", "last_access")

    def __init__(
        self, key: tuple[int, ...], value: torch.Tensor, parent: _Node | None, last_access: int
    ) -> None:
        self.key = key
        self.value = value
        # None for the root and for nodes that were evicted or dropped by reset.
        self.parent = parent
        self.children: dict[ChildKey, _Node] = {}
        self.ref_count = 0
        self.last_access = last_access

    def describe(self) -> str:
        shown = ", ".join(map(str, self.key[:8])) + (", ..." if len(self.key) > 8 else "")
        return f"node [{shown}] ({len(self.key)} tokens)"


@dataclass(frozen=True)
class RadixHandle(CacheHandle):
    prefix_len: int
    # NOTE: a split keeps the node object as the lower half, so a handle stays valid across splits.
    node: _Node = field(repr=False)
    root: _Node = field(repr=False)

    def get_matched_indices(self) -> torch.Tensor:
        parts = []
        node = self.node
        while node is not self.root:
            if node.parent is None:
                raise ValueError("stale handle: its prefix was evicted or the cache was reset")
            parts.append(node.value)
            node = node.parent
        if not parts:
            return self.root.value.clone()
        return torch.cat(parts[::-1])


class RadixPrefixCache(BasePrefixCache):
    """Invariants (check_integrity verifies each): a child never has more references than its
    parent; `_evictable_leaves` is exactly the unreferenced leaves, each with a live heap entry;
    the token counters equal a recount; no KV location is held twice. Evict pops the heap, so
    its cost grows with the nodes it frees (times log of the leaf count), not the tree size."""

    def __init__(self, page_size: int, device: torch.device | str) -> None:
        check_page_size(page_size)
        self.page_size = page_size
        empty = torch.empty(0, dtype=torch.int64, device=device)
        # Taken from a tensor so that "cuda" becomes "cuda:0" and compares equal to value.device.
        self.device = empty.device
        self._root = _Node((), empty, None, last_access=0)
        self._clock = 1  # logical time: every touch gets a fresh tick, so no two nodes tie
        self._evictable_tokens = 0
        self._protected_tokens = 0
        # Exactly the unreferenced non-root leaves: the nodes `evict` may free next.
        self._evictable_leaves: set[_Node] = set()
        # (last_access, push order, node). An entry is live only while its node is in
        # _evictable_leaves and still has that last_access; the rest are skipped when popped.
        self._lru_heap: list[tuple[int, int, _Node]] = []
        self._push_order = itertools.count()

    # ---- the contract ------------------------------------------------------------------------

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        check_input_ids(input_ids)
        tokens = tuple(input_ids.tolist())
        node, matched = self._walk(tokens, self._aligned(len(tokens)))
        return MatchResult(handle=RadixHandle(matched, node, self._root))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        check_insert_args(input_ids, indices)
        tokens = tuple(input_ids.tolist())
        end = self._aligned(len(tokens))
        node, cached = self._walk(tokens, end)
        if cached < end:
            # Copied: the caller's tensor is often a view into a table it will overwrite.
            value = indices[cached:end].to(self.device, torch.int64, copy=True)
            leaf = _Node(tokens[cached:end], value, node, self._tick())
            self._evictable_leaves.discard(node)  # it has a child now
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._evictable_tokens += len(leaf.key)
            self._add_evictable_leaf(leaf)
            node = leaf
        return InsertResult(matched_len=cached, handle=RadixHandle(end, node, self._root))

    def lock(self, handle: CacheHandle) -> None:
        for node in self._path_to_root(handle):
            if node.ref_count == 0:
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
                self._evictable_leaves.discard(node)
            node.ref_count += 1

    def unlock(self, handle: CacheHandle) -> None:
        path = self._path_to_root(handle)
        # A child never has more references than its parent, so checking the first node suffices.
        if path and path[0].ref_count == 0:
            raise RuntimeError(
                f"unlock of a handle that is not locked ({handle.prefix_len} tokens); "
                "each unlock must follow a lock of the same handle"
            )
        for node in path:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._protected_tokens -= len(node.key)
                self._evictable_tokens += len(node.key)
                if not node.children:
                    self._add_evictable_leaf(node)

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens < 0:
            raise ValueError(f"cannot evict a negative number of tokens ({num_tokens})")
        if num_tokens > self._evictable_tokens:
            raise ValueError(
                f"cannot evict {num_tokens} tokens: only {self._evictable_tokens} are evictable"
            )
        freed: list[torch.Tensor] = []
        freed_len = 0
        while freed_len < num_tokens:
            if not self._lru_heap:
                raise CacheIntegrityError(
                    f"no evictable leaf left after freeing {freed_len} of {num_tokens} tokens, "
                    f"yet {self._evictable_tokens} tokens are counted evictable"
                )
            stamp, _, node = heapq.heappop(self._lru_heap)
            if node not in self._evictable_leaves or node.last_access != stamp:
                continue
            self._evictable_leaves.remove(node)
            parent = node.parent
            assert parent is not None  # in the tree, since it is in _evictable_leaves
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._evictable_tokens -= len(node.key)
            freed.append(node.value)
            freed_len += len(node.key)
            if parent is not self._root and not parent.children and parent.ref_count == 0:
                self._add_evictable_leaf(parent)
        return torch.cat(freed) if freed else self._root.value.clone()

    def reset(self) -> torch.Tensor:
        if self._protected_tokens:
            raise RuntimeError(
                f"cannot reset the prefix cache: {self._protected_tokens} tokens are locked "
                "by running requests; retry when they have finished"
            )
        values = [node.value for node in self._iter_nodes()]
        for child in self._root.children.values():
            child.parent = None  # makes every handle into the dropped tree stale
        self._root.children = {}
        self._evictable_tokens = 0
        self._evictable_leaves.clear()
        self._lru_heap.clear()
        return torch.cat(values) if values else self._root.value.clone()

    def empty_handle(self) -> CacheHandle:
        return RadixHandle(0, self._root, self._root)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable_tokens, self._protected_tokens)

    def check_integrity(self) -> None:
        root = self._root
        if root.key or len(root.value) or root.parent is not None or root.ref_count:
            raise CacheIntegrityError("the root must have no tokens, no parent and no references")
        evictable = protected = 0
        leaves: set[_Node] = set()
        values: list[torch.Tensor] = []
        for node in self._iter_nodes():
            problem = self._node_problem(node)
            if problem is not None:
                raise CacheIntegrityError(f"{node.describe()} {problem}")
            if node.ref_count:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
            values.append(node.value)
        if (evictable, protected) != (self._evictable_tokens, self._protected_tokens):
            raise CacheIntegrityError(
                f"counters say {self._evictable_tokens} evictable / {self._protected_tokens} "
                f"protected tokens, recount says {evictable} / {protected}"
            )
        if leaves != self._evictable_leaves:
            extra, missing = self._evictable_leaves - leaves, leaves - self._evictable_leaves
            raise CacheIntegrityError(
                f"evictable-leaf set has {len(extra)} nodes that are not unreferenced leaves "
                f"and misses {len(missing)} that are"
            )
        queued = {node for stamp, _, node in self._lru_heap if stamp == node.last_access}
        if not leaves <= queued:
            raise CacheIntegrityError(
                f"{len(leaves - queued)} evictable leaves have no live entry in the LRU heap"
            )
        if values:
            # A mark per location, O(tokens + largest location): sorting (torch.unique) is
            # several times slower on CPU at 100k nodes.
            locations = torch.cat(values)
            if int(locations.min()) < 0:
                raise CacheIntegrityError("the tree holds a negative KV location")
            seen = torch.zeros(int(locations.max()) + 1, dtype=torch.bool, device=self.device)
            seen[locations] = True
            if int(seen.sum()) != locations.numel():
                raise CacheIntegrityError("a KV location is held by the tree more than once")

    # ---- internals ---------------------------------------------------------------------------

    def _aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.page_size

    def _child_key(self, tokens: tuple[int, ...], pos: int) -> ChildKey:
        if self.page_size == 1:
            return tokens[pos]
        return tokens[pos : pos + self.page_size]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock - 1

    def _walk(self, tokens: tuple[int, ...], end: int) -> tuple[_Node, int]:
        """Follow tokens[:end] (page-aligned) down the tree; returns the node where the match
        ends and its length, splitting the last node if the match ends inside it."""
        node, pos = self._root, 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            matched = self._match_run(child.key, tokens, pos, end)
            ends_inside = matched < len(child.key)
            if ends_inside:
                child = self._split(child, matched)
            self._touch(child)
            node, pos = child, pos + matched
            if ends_inside:
                break
        return node, pos

    def _match_run(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int, end: int) -> int:
        """Length of the common whole-page prefix of key and tokens[pos:end]; the first page is
        known to match (it was the child's dict key). Slices compare in C; a binary search
        over pages finds the first mismatch in O(len) total."""
        ps = self.page_size
        limit = min(len(key), end - pos)
        if tokens[pos : pos + limit] == key[:limit]:
            return limit
        lo, hi = 1, limit // ps  # pages: the first lo match, the first hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tokens[pos + lo * ps : pos + mid * ps] == key[lo * ps : mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo * ps

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node after `at` tokens; the new upper half is returned, node keeps the rest."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:at], node.value[:at], parent, node.last_access)
        upper.ref_count = node.ref_count  # every lock through node also passes through upper
        parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _touch(self, node: _Node) -> None:
        node.last_access = self._tick()
        if node in self._evictable_leaves:
            self._push(node)

    def _add_evictable_leaf(self, node: _Node) -> None:
        self._evictable_leaves.add(node)
        self._push(node)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._lru_heap, (node.last_access, next(self._push_order), node))
        # Rebuild once stale entries outnumber live ones, so the heap stays O(live leaves);
        # the rebuild's cost is paid for by the pushes that made the stale entries.
        if len(self._lru_heap) > 2 * len(self._evictable_leaves) + 64:
            self._lru_heap = [
                (n.last_access, next(self._push_order), n) for n in self._evictable_leaves
            ]
            heapq.heapify(self._lru_heap)

    def _path_to_root(self, handle: CacheHandle) -> list[_Node]:
        """The handle's node and its ancestors, root excluded; raises for foreign/stale handles."""
        if not isinstance(handle, RadixHandle) or handle.root is not self._root:
            raise ValueError("the handle was not made by this cache")
        path = []
        node = handle.node
        while node is not self._root:
            if node.parent is None:
                raise ValueError("stale handle: its prefix was evicted or the cache was reset")
            path.append(node)
            node = node.parent
        return path

    def _iter_nodes(self) -> Iterator[_Node]:
        """Every node but the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _node_problem(self, node: _Node) -> str | None:
        parent = node.parent
        n = len(node.key)
        value = node.value
        if parent is None or parent.children.get(self._child_key(node.key, 0)) is not node:
            return "is not under its parent's key for its first page"
        if n == 0 or n % self.page_size:
            return f"is not a positive multiple of the page size {self.page_size}"
        if value.shape != (n,) or value.dtype != torch.int64 or value.device != self.device:
            return (
                f"has a {value.dtype} value of shape {tuple(value.shape)} on {value.device}, "
                f"expected int64 of shape ({n},) on {self.device}"
            )
        if node.ref_count < 0:
            return "has a negative reference count"
        if parent is not self._root and node.ref_count > parent.ref_count:
            return f"has {node.ref_count} references, more than its parent's {parent.ref_count}"
        if node.last_access >= self._clock:
            return "was used at a time the logical clock has not reached"
        return None
