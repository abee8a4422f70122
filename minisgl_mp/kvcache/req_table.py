from __future__ import annotations

import torch


class ReqTable:
    """The page table: per running-request slot, the KV slot of each of its token positions.

    table[r, i] is where token i of the request in row r keeps its KV. Rows are handed out
    and taken back as requests start and finish. Requests allocate whole pages, so a row holds
    `max_context_len` rounded up to a whole number of pages: a request at the context limit may
    own a page that runs past it.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device, page_size: int = 1) -> None:
        width = -(-max_context_len // page_size) * page_size
        self.table = torch.zeros((max_reqs, width), dtype=torch.int64, device=device)
        self.max_context_len = max_context_len
        self._free = list(range(max_reqs - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free)
