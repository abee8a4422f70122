"""Owns the KV memory of the scheduler: free pages, the prefix cache and the page table.

Every KV slot is in exactly one of three states: free (in the allocator), in the prefix cache
(evictable, or protected while a running request locks it), or private to one running
request (between its handle and its alloc_len). `check_health` verifies the three add up.
"""

from __future__ import annotations

from typing import Sequence

import torch

from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.kvcache.base import BasePrefixCache
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.scheduler.req import Req
from minisgl_mp.utils.device import host_tensor


class CacheManager:
    def __init__(self, allocator: PageAllocator, cache: BasePrefixCache, table: ReqTable) -> None:
        self.allocator = allocator
        self.cache = cache
        self.table = table
        self.page_size = allocator.page_size
        self.device = table.table.device

    # ---- capacity -------------------------------------------------------------------------
    @property
    def available_tokens(self) -> int:
        """Slots that can be had now: free pages plus what eviction can free."""
        return self.allocator.num_free_pages * self.page_size + self.cache.size_info.evictable_tokens

    def pages_for(self, req: Req, num_tokens: int) -> int:
        """New pages `req` needs so that its next `num_tokens` tokens have KV slots."""
        short = req.computed_len + num_tokens - req.alloc_len
        return max(0, -(-short // self.page_size))

    # ---- a request's life -----------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Take a page-table row and lock the longest cached prefix up to
        `req.prefix_match_limit`. Returns False, changing nothing, when no row is free."""
        row = self.table.alloc()
        if row is None:
            return False
        match_ids = torch.tensor(req.token_ids[: req.prefix_match_limit], dtype=torch.int64)
        handle = self.cache.match_prefix(match_ids).handle
        self.cache.lock(handle)
        n = handle.prefix_len
        if n:
            self.table.table[row, :n] = handle.get_matched_indices()
        req.row, req.handle, req.computed_len, req.alloc_len = row, handle, n, n
        return True

    def reserve(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """KV slots for `req`'s next `num_tokens` tokens, allocating pages (evicting cached
        prefixes if needed). None, with nothing changed, when the pool cannot supply them."""
        pages = self.pages_for(req, num_tokens)
        if pages and not self._ensure_free_pages(pages):
            return None
        row = req.row
        if pages:
            slots = self.allocator.alloc_slots(pages)
            self.table.table[row, req.alloc_len : req.alloc_len + slots.numel()] = slots
            req.alloc_len += slots.numel()
        return self.table.table[row, req.computed_len : req.computed_len + num_tokens]

    def reserve_decodes(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """The KV slot of each decoding request's next token, [len(reqs)] in order: `reserve(r,
        1)` for all of them at once. Requests whose pages are full get one fresh page each from
        a single allocation, written into the page table with one indexed store; then one
        gather reads every slot. None, with nothing changed, when the pool cannot supply them."""
        if not reqs:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        needy = [r for r in reqs if r.computed_len + 1 > r.alloc_len]  # alloc_len >= computed_len always
        if needy:
            if not self._ensure_free_pages(len(needy)):
                return None
            pages = self.allocator.alloc_pages(len(needy))
            rows = host_tensor([r.row for r in needy], torch.int64, self.device)
            offsets = torch.arange(self.page_size, device=self.device)
            cols = host_tensor([r.alloc_len for r in needy], torch.int64, self.device)[:, None] + offsets
            self.table.table[rows[:, None], cols] = pages[:, None] * self.page_size + offsets
            for r in needy:
                r.alloc_len += self.page_size
        rows = host_tensor([r.row for r in reqs], torch.int64, self.device)
        cols = host_tensor([r.computed_len for r in reqs], torch.int64, self.device)
        return self.table.table[rows, cols]

    def cache_prefix(self, req: Req) -> None:
        """Insert the computed tokens into the prefix cache and move the request's lock there.

        The table is remapped to the cache's copies before the request's duplicates are freed,
        so the page table never points at a freed slot.
        """
        n = req.computed_len
        old = req.handle
        ids = torch.tensor(req.token_ids[:n], dtype=torch.int64)
        result = self.cache.insert_prefix(ids, self.table.table[req.row, :n])
        new = result.handle
        duplicates = self.table.table[req.row, old.prefix_len : result.matched_len].clone()
        if new.prefix_len:
            self.table.table[req.row, : new.prefix_len] = new.get_matched_indices()
        self.cache.lock(new)
        self.cache.unlock(old)
        req.handle = new
        self.allocator.free_slots(duplicates)
        if new.prefix_len > req.alloc_len:
            raise RuntimeError(f"prefix cache kept {new.prefix_len} tokens of {req!r}, past its allocation")
        # For a cache that keeps nothing (naive), the private region simply starts at 0 again.

    def release(self, req: Req, keep_in_cache: bool = True) -> None:
        """The request stops holding KV (finished, aborted or retracted). Its computed tokens go
        into the prefix cache (the next chat turn or a resumed request wants them); whatever the
        cache does not keep is freed, and so is its page-table row."""
        if req.row is None:
            return
        if keep_in_cache and req.computed_len > 0:
            self.cache_prefix(req)
        self.allocator.free_slots(self.table.table[req.row, req.cache_owned_len : req.alloc_len].clone())
        self.cache.unlock(req.handle)
        self.table.free(req.row)
        req.row, req.handle, req.computed_len, req.alloc_len = None, None, 0, 0

    # ---- whole-pool operations --------------------------------------------------------------
    def _ensure_free_pages(self, pages: int) -> bool:
        short = pages - self.allocator.num_free_pages
        if short <= 0:
            return True
        need = short * self.page_size
        if self.cache.size_info.evictable_tokens < need:
            return False
        self.allocator.free_slots(self.cache.evict(need))
        return True

    def flush(self) -> int:
        """Drop the whole prefix cache (nothing may be locked). Returns tokens freed."""
        freed = self.cache.reset()
        self.allocator.free_slots(freed)
        return int(freed.numel())

    def stats(self) -> dict[str, int]:
        size = self.cache.size_info
        return {
            "total_tokens": self.allocator.num_slots,
            "free_tokens": self.allocator.num_free_pages * self.page_size,
            "evictable_tokens": size.evictable_tokens,
            "protected_tokens": size.protected_tokens,
        }

    def check_health(self, private_tokens: int, full: bool = True) -> None:
        """free + evictable + protected + private == pool, and (when `full`) the cache's own
        invariants hold. `private_tokens` is what running requests hold themselves."""
        s = self.stats()
        counted = s["free_tokens"] + s["evictable_tokens"] + s["protected_tokens"] + private_tokens
        if counted != s["total_tokens"]:
            raise RuntimeError(
                f"KV page leak: free {s['free_tokens']} + evictable {s['evictable_tokens']} + "
                f"protected {s['protected_tokens']} + private {private_tokens} = {counted}, "
                f"pool has {s['total_tokens']}"
            )
        if full:
            self.cache.check_integrity()
