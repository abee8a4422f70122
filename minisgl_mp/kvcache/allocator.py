from __future__ import annotations

import torch


class PageAllocator:
    """Hands out pages of the KV pool. Page p owns slots [p * page_size, (p + 1) * page_size).

    Free pages sit in a stack (a tensor, so handing out k pages is one slice, not k Python
    operations). Allocation never raises for lack of room: it returns None.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._stack = torch.arange(num_pages - 1, -1, -1, dtype=torch.int64, device=device)
        self._num_free = num_pages
        # Which pages are free, so a double free is caught before it hands a page out twice.
        self._is_free = torch.ones(num_pages, dtype=torch.bool, device=device)
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        # The double-free check reads the device: on a GPU that would wait for the forward that
        # overlap scheduling leaves running, at every step where a request ends.
        self.check_frees = device.type == "cpu"

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        if n > self._num_free:
            return None
        self._num_free -= n
        # The top of the stack holds the lowest pages, so a fresh pool hands out ascending runs
        # (and freed runs come back in their order): a request's KV then lies along memory,
        # which the CPU's prefetchers follow (descending runs read ~30% slower in decode).
        pages = self._stack[self._num_free : self._num_free + n].flip(0)
        # index_fill_, not `self._is_free[pages] = False`: indexing assignment sends the Python
        # scalar to the device as a pageable copy, which synchronises the stream, and this runs
        # every step while overlap scheduling has the previous forward in flight.
        self._is_free.index_fill_(0, pages, False)
        return pages

    def alloc_slots(self, num_pages: int) -> torch.Tensor | None:
        """Slots of `num_pages` fresh pages, page by page: [num_pages * page_size]."""
        pages = self.alloc_pages(num_pages)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + self._offsets).flatten()

    def free_slots(self, slots: torch.Tensor) -> None:
        """Give back the pages of `slots`, which must be whole pages (runs of page_size slots,
        each run starting at a page boundary)."""
        if slots.numel() == 0:
            return
        pages = slots[:: self.page_size] // self.page_size if self.page_size > 1 else slots
        n = pages.numel()
        if self.check_frees and (bool(self._is_free[pages].any()) or (n > 1 and pages.unique().numel() != n)):
            raise RuntimeError(f"a page was freed twice: {sorted(set(pages.tolist()))[:16]} ...")
        self._is_free.index_fill_(0, pages, True)  # (no sync: see alloc_pages)
        self._stack[self._num_free : self._num_free + n] = pages.flip(0)
        self._num_free += n

    def reset(self) -> None:
        self._stack = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64, device=self._stack.device)
        self._num_free = self.num_pages
        self._is_free.fill_(True)
