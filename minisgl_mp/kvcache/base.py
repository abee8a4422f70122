"""The prefix-cache interface: what the scheduler may ask of any backend, and the result types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

PREFIX_CACHE_TYPES = ("radix", "naive")


class CacheIntegrityError(RuntimeError):
    """A prefix cache's bookkeeping disagrees with its contents (a bug, never a user error)."""


class SizeInfo(NamedTuple):
    """Tokens (not pages) the cache holds; together they are everything it holds."""

    evictable_tokens: int
    protected_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens


class CacheHandle(ABC):
    """Where a match or an insert ended: the first `prefix_len` tokens of the request's input.

    Lock a handle to keep its prefix alive; its KV locations stay valid while it is locked.
    An unlocked handle may go stale once `evict` or `reset` runs.
    """

    prefix_len: int

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor:
        """KV locations of the first `prefix_len` tokens, in order: int64, shape [prefix_len]."""


@dataclass(frozen=True)
class MatchResult:
    handle: CacheHandle


@dataclass(frozen=True)
class InsertResult:
    """After `insert_prefix(input_ids, indices)`, ownership of `indices` splits in three:

    indices[:matched_len]                  were already cached; the tree keeps its own copies, so
                                           any of these the caller allocated itself are duplicates
                                           the caller frees.
    indices[matched_len:handle.prefix_len] now belong to the cache; the caller must not free them.
    indices[handle.prefix_len:]            (the part past the last whole page, or everything for a
                                           backend that keeps nothing) stay the caller's to free.
    """

    matched_len: int
    handle: CacheHandle


class BasePrefixCache(ABC):
    """Maps token prefixes to the KV locations that hold them, in whole pages of `page_size`.

    Locking a handle adds one reference to every cached token of its prefix and unlocking removes
    it; tokens with a reference are protected, the rest are evictable. `evict` frees only
    evictable tokens, least recently matched or inserted first, and returns their locations to
    the caller, who owns them from then on.
    """

    page_size: int
    device: torch.device

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        """Longest cached whole-page prefix of `input_ids` (1-D); never adds or removes tokens."""

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        """Cache the whole pages of `input_ids` with their KV locations `indices` (same length)."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one `lock`; raises if the handle's prefix is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least `num_tokens` evictable tokens (whole nodes, so maybe more); returns their
        int64 locations. Raises ValueError if fewer than `num_tokens` are evictable."""

    @abstractmethod
    def reset(self) -> torch.Tensor:
        """Drop everything and return every location held; raises if anything is locked."""

    @abstractmethod
    def empty_handle(self) -> CacheHandle:
        """A handle with prefix_len 0; lock and unlock accept it and change nothing."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Recount everything; raise CacheIntegrityError naming the first inconsistency."""


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def check_input_ids(input_ids: torch.Tensor) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise ValueError(f"input_ids must be a 1-D tensor, got {_describe(input_ids)}")


def check_insert_args(input_ids: torch.Tensor, indices: torch.Tensor) -> None:
    check_input_ids(input_ids)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D tensor, got {_describe(indices)}")
    if len(indices) != len(input_ids):
        raise ValueError(
            f"indices has {len(indices)} entries but input_ids has {len(input_ids)} tokens; "
            "every token needs exactly one KV location"
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def create_prefix_cache(
    cache_type: str, page_size: int, device: torch.device | str
) -> BasePrefixCache:
    # NOTE: imported here because both backends import this module.
    from minisgl_mp.kvcache.naive_cache import NaiveCache
    from minisgl_mp.kvcache.radix_cache import RadixPrefixCache

    if cache_type == "radix":
        return RadixPrefixCache(page_size=page_size, device=device)
    if cache_type == "naive":
        return NaiveCache(page_size=page_size, device=device)
    raise ValueError(
        f"unknown prefix cache type {cache_type!r}; valid types: {', '.join(PREFIX_CACHE_TYPES)}"
    )
