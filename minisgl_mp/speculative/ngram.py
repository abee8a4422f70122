"""N-gram drafts: the tokens that followed the last earlier occurrence of a request's most
recent n tokens, in its own prompt and output (llama.cpp's lookup decoding, SGLang's and
vLLM's `ngram`).

Work people give small models copies: a rewrite, a summary quoting its source, an edit of
pasted code, an answer from a document. There the text after an earlier occurrence of the
last few tokens is often the text that comes next, and checking K such tokens costs about one
decode step, which on a CPU is bound by reading the weights, not by the tokens it runs.

`NgramIndex` keeps, per n in [min_n, max_n], where each n-gram of the sequence last ended, and
is extended token by token as the request grows: a draft is a dictionary look-up per n, never a
scan of the text. `SharedNgrams` does the same, for one n, over the text of requests that have
finished (what the prefix cache holds): a request with nothing to copy from its own tokens can
draft from an earlier answer (the same question again, a document quoted by another request).
`DraftPolicy` keeps a request from drafting while its drafts keep failing, so
text with nothing to copy is not slowed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token sequence last ended, updated as the
    sequence grows. Only the latest occurrence is kept: recent text predicts best."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence, excluding the sequence's own end
        self._ends: dict[tuple[int, ...], int] = {}
        self._pending: list[tuple[tuple[int, ...], int]] = []  # the suffix n-grams, indexed once passed

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            # The n-grams ending at the old end get a following token now: index them.
            for gram, end in self._pending:
                self._ends[gram] = end
            self.tokens.append(t)
            end = len(self.tokens)
            self._pending = [(tuple(self.tokens[end - n:]), end) for n in range(self.min_n, self.max_n + 1)
                             if end >= n]

    def truncate(self, length: int) -> None:
        """Forget tokens past `length` (a request retracted, rejected or restarted): rebuilt
        from the kept tokens, as stale positions would point past the end."""
        if length >= len(self.tokens):
            return
        kept = self.tokens[:length]
        self.tokens, self._ends, self._pending = [], {}, []
        self.extend(kept)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram that occurred before; [] when none did."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """(n, draft): `draft`'s matched suffix length too (0 with no match)."""
        if k <= 0:
            return 0, []
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._ends.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return n, self.tokens[start:start + k]
        return 0, []


class SharedNgrams:
    """For the text of finished requests: each n-gram's latest occurrence, the `capacity` most
    recently seen kept (older ones forgotten first). One n only, so adding a request costs one
    dictionary write per token."""

    def __init__(self, n: int = 4, capacity: int = 1 << 20) -> None:
        if n < 1 or capacity < 1:
            raise ValueError(f"shared n-grams need n >= 1 and capacity >= 1, got {n} and {capacity}")
        self.n, self.capacity = n, capacity
        self._at: OrderedDict[tuple[int, ...], tuple[tuple[int, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def clear(self) -> None:
        self._at.clear()

    def add(self, tokens: list[int]) -> None:
        seq, n, at = tuple(tokens), self.n, self._at
        for end in range(n, len(seq)):  # (the last n-gram has nothing after it)
            key = seq[end - n:end]
            at[key] = (seq, end)
            at.move_to_end(key)
        while len(at) > self.capacity:
            at.popitem(last=False)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.n:
            return []
        hit = self._at.get(tuple(tokens[-self.n:]))
        if hit is None:
            return []
        seq, end = hit
        return list(seq[end:end + k])


@dataclass
class DraftPolicy:
    """How much a request drafts. The draft length follows its acceptance as transformers'
    assisted generation does (two more after a fully accepted draft, one fewer otherwise, between
    1 and `max_len`), since a rejected draft token costs a row of compute. After `patience`
    verifications in a row with nothing accepted it stops for a while, twice as long each time it
    fails again (up to `max_pause` steps); an accepted draft resets both."""

    max_len: int
    patience: int = 2
    max_pause: int = 64
    failures: int = 0
    pause: int = 0  # steps left without drafting
    backoff: int = 4
    length: int = 0  # the next draft's length (0: max_len, at the start)

    def __post_init__(self) -> None:
        self.length = self.length or self.max_len

    def wants_draft(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.length = min(self.max_len, self.length + 2) if accepted == drafted else max(1, self.length - 1)
        if accepted > 0:
            self.failures, self.backoff = 0, 4
            return
        self.failures += 1
        if self.failures >= self.patience:
            self.pause, self.failures = self.backoff, 0
            self.backoff = min(self.backoff * 2, self.max_pause)
