"""The grammar backend interface and its cache of compiled grammars.

Contract:
- `validate(key)` parses the grammar without the vocabulary (fast, on the caller's thread) and
  raises ValueError naming the problem; it is what turns a bad schema into a 400.
- `compile(key)` returns a Future of the compiled grammar. Compilation runs in a thread pool,
  never on the scheduler's step; a request waits outside the waiting queue until its future is
  done. Futures are cached by key (finished ones in LRU order, failures too: they are as
  deterministic as successes), so concurrent requests with one schema compile it once.
- `matcher(compiled)` is one request's state: it accepts each sampled token and fills that
  request's row of the token bitmask. `request_matcher` gives a request its matcher: the
  grammar's, behind the request's thinking when it requires reasoning (reasoning.py).
- The bitmask is filled and applied only for constrained rows; an unconstrained batch never
  calls the backend.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from minisgl_mp.constrained.matcher import GrammarMatcher
from minisgl_mp.constrained.reasoning import ReasoningMatcher
from minisgl_mp.engine_config import GRAMMAR_BACKENDS
from minisgl_mp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # SamplingParams' field names
MAX_CACHED_GRAMMARS = 256
NO_BACKEND_FOR_BUDGET = ("thinking_token_budget needs a grammar backend (the think-end token is forced through "
                         "the token mask): this server runs with --grammar-backend none")


class GrammarKey(NamedTuple):
    kind: str  # one of GRAMMAR_KINDS
    spec: str  # the schema (JSON text), the regex, or the EBNF


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """The request's constraint, if any (SamplingParams allows at most one)."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind)
        if spec is not None:
            return GrammarKey(kind, spec)
    return None


class GrammarBackend(ABC):
    def __init__(self, max_workers: int = 2, think_end_ids: tuple[int, ...] = (),
                 stop_token_ids: frozenset[int] = frozenset()) -> None:
        self.think_end_ids = think_end_ids  # the tokens of reasoning.THINK_END
        self.stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()  # compile() may be called from any thread
        self.cache_hits = 0
        self.cache_misses = 0
        # Reused step after step (grown when a batch is larger): a filled row is overwritten
        # whole, and rows no one filled are never applied, so it needs no clearing.
        self._bitmask: torch.Tensor | None = None

    # ---- what a backend implements ----------------------------------------------------------
    @abstractmethod
    def validate(self, key: GrammarKey) -> None:
        """Raise ValueError naming what is wrong with the grammar."""

    @abstractmethod
    def _compile(self, key: GrammarKey) -> Any:
        """The compiled grammar (runs in the pool); raises ValueError for a bad grammar."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        ...

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask of `rows` rows ([rows, ceil(vocab / 32)] int32), every token allowed."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """In place, for each i in rows: logits[i, t] = -inf where bit t of bitmask[i] is clear."""

    # ---- the cache ----------------------------------------------------------------------------
    def compile(self, key: GrammarKey) -> Future[Any]:
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            self.cache_misses += 1
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            self._evict()
        return fut

    def _evict(self) -> None:
        # Only finished entries go: an unfinished one has requests waiting on it.
        excess = len(self._cache) - MAX_CACHED_GRAMMARS
        for k in [k for k, f in self._cache.items() if f.done()][: max(0, excess)]:
            del self._cache[k]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fill_and_apply(self, logits: torch.Tensor, matchers: list[GrammarMatcher], rows: list[int]) -> None:
        """Mask logits[rows[j]] with matchers[j]'s allowed tokens, in place."""
        # logits: [B, V]; bitmask rows line up with logits rows, only `rows` are filled.
        batch = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            grown = 0 if self._bitmask is None else 2 * self._bitmask.shape[0]
            self._bitmask = self.allocate_bitmask(max(batch, grown))
        bitmask = self._bitmask[:batch]
        for m, i in zip(matchers, rows):
            m.fill_bitmask(bitmask, i)
        self.apply_bitmask(logits, bitmask, rows)


def request_matcher(backend: GrammarBackend | None, compiled: Any | None, params: SamplingParams
                    ) -> GrammarMatcher | None:
    """The matcher of a request: its grammar's (`compiled`; None when it has no grammar),
    behind its thinking when it requires reasoning (with a thinking budget it needs one even
    without a grammar); None when nothing masks its tokens. Raises ValueError when it needs a
    backend and there is none."""
    budget = params.thinking_token_budget if params.require_reasoning else None
    if compiled is None and budget is None:
        return None
    if backend is None:
        raise ValueError(NO_BACKEND_FOR_BUDGET)
    grammar = None if compiled is None else backend.matcher(compiled)
    if not params.require_reasoning:
        return grammar
    banned: frozenset[int] = frozenset()
    if grammar is not None:  # only a constrained answer is kept from stopping inside the thinking
        banned = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else backend.stop_token_ids)
    return ReasoningMatcher(grammar, backend.think_end_ids, budget, banned)


def create_grammar_backend(name: str, tokenizer: Any | None, vocab_size: int, stop_token_ids: frozenset[int],
                           any_whitespace: bool = False) -> GrammarBackend | None:
    """The backend `name` ("auto": xgrammar when installed), or None for "none" (constrained
    requests are then refused). `vocab_size` is the model's: it may exceed the tokenizer's, and
    the padding rows are never allowed."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")
    if name == "none":
        return None
    if tokenizer is None:
        if name == "xgrammar":
            raise ValueError("--grammar-backend xgrammar needs the model's tokenizer, and this model has none")
        return None
    try:
        from minisgl_mp.constrained.xgrammar_backend import XGrammarBackend
    except ImportError as e:
        if name == "xgrammar":
            raise ValueError(f"--grammar-backend xgrammar: the xgrammar package cannot be imported ({e})") from e
        logger.warning("xgrammar is not installed: structured output is off (--grammar-backend none)")
        return None
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace)
