"""A prefix cache that caches nothing: every request computes its whole prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_mp.kvcache.base import (
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    MatchResult,
    SizeInfo,
    check_input_ids,
    check_insert_args,
    check_page_size,
)


@dataclass(frozen=True)
class NaiveHandle(CacheHandle):
    device: torch.device
    prefix_len: int = 0

    def get_matched_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)


class NaiveCache(BasePrefixCache):
    """Never matches and keeps nothing, so `insert_prefix` leaves every location with the caller."""

    def __init__(self, page_size: int, device: torch.device | str) -> None:
        check_page_size(page_size)
        self.page_size = page_size
        self.device = torch.device(device)
        self._empty = NaiveHandle(device=self.device)

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        check_input_ids(input_ids)
        return MatchResult(handle=self._empty)

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        check_insert_args(input_ids, indices)
        return InsertResult(matched_len=0, handle=self._empty)

    def lock(self, handle: CacheHandle) -> None:
        _check_handle(handle)

    def unlock(self, handle: CacheHandle) -> None:
        _check_handle(handle)

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > 0:
            raise ValueError(f"cannot evict {num_tokens} tokens: only 0 are evictable")
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def empty_handle(self) -> CacheHandle:
        return self._empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_tokens=0, protected_tokens=0)

    def check_integrity(self) -> None:
        """Holds no state, so there is nothing that could disagree."""


def _check_handle(handle: CacheHandle) -> None:
    if not isinstance(handle, NaiveHandle):
        raise ValueError(f"NaiveCache got a handle of type {type(handle).__name__}")
