"""One request's grammar state, and the token bitmask it fills."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit set = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted its stop token)."""


# The bitmask: [rows, ceil(vocab / 32)] int32; token t is bit t % 32 of word t // 32.
def _bit(token: int) -> tuple[int, int]:
    """(word, the word's value with only the token's bit set, as a signed int32)."""
    value = 1 << (token & 31)
    return token >> 5, value - (1 << 32) if value >= 1 << 31 else value


def allow_all_but(bitmask: torch.Tensor, row: int, banned: Iterable[int] = ()) -> None:
    bitmask[row].fill_(-1)
    for token in banned:
        word, value = _bit(token)
        if word < bitmask.shape[1]:
            bitmask[row, word] &= ~value


def allow_only(bitmask: torch.Tensor, row: int, token: int) -> None:
    bitmask[row].zero_()
    word, value = _bit(token)
    bitmask[row, word] = value
