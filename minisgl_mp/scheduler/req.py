"""A request as the scheduler sees it: its tokens, where their KV lives, and why it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from concurrent.futures import Future
from typing import Any

from minisgl_mp.constrained.base import GrammarMatcher
from minisgl_mp.kvcache.base import CacheHandle
from minisgl_mp.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, the context length, or the KV pool's capacity
    ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top alternatives at one step."""

    token_logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


class Req:
    """KV bookkeeping, in named lengths over `token_ids` (prompt, then output):

        [0, cache_owned_len)            KV owned by the prefix cache, locked through `handle`
                                        (cache_owned_len is handle.prefix_len)
        [cache_owned_len, alloc_len)    KV slots this request allocated itself (whole pages)
        [0, computed_len)               tokens whose KV has been computed (or matched)
        [computed_len, seq_len)         tokens still to run through the model (`extend_len`)

    `row` is the request's row in the page table while it holds KV; None while it waits.
    """

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, max_seq_len: int,
                 eos_ids: frozenset[int], stop_checker: Any | None = None) -> None:
        self.rid = rid
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        # Generation ends with LENGTH when seq_len reaches this (context, max_tokens, pool).
        self.max_seq_len = max_seq_len
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        # An IncrementalDetokenizer when the request has stop strings.
        self.stop_checker = stop_checker

        self.row: int | None = None
        self.handle: CacheHandle | None = None
        self.computed_len = 0
        self.alloc_len = 0

        self.prefix_hit_len: int | None = None  # cache hit at first admission (usage.cached_tokens)
        # The scheduler's prefill round at which this request (re)joined the waiting queue:
        # rounds waited = current round - this, with no per-round update of every waiter.
        self.wait_start_round = 0
        self.num_retractions = 0
        self.finish_reason: FinishReason | None = None
        self.matched_stop: int | str | None = None
        self.logprobs: list[TokenLogprobs] = []
        # Prompt log-probabilities: the logits at position p score prompt token p + 1. This is
        # the next position whose logits are wanted (None: not asked for); prefill advances it
        # to prompt_len - 1. They go out with the first output, then the list is emptied.
        start = params.logprob_start_len
        self.prompt_logprob_pos: int | None = None if start is None else min(max(start, 1), self.prompt_len) - 1
        self.prompt_logprobs: list[TokenLogprobs] = []
        # Structured output: the compile under way (the request waits outside the waiting
        # queue until it is done), then this request's matcher. The matcher has accepted exactly
        # the output tokens: retraction keeps them (resuming recomputes their KV, it does not
        # sample them again), so it never needs a rebuild.
        self.grammar_future: Future[Any] | None = None
        self.grammar: GrammarMatcher | None = None
        # The seed its random draws come from: its own, or one the sampler drew at its first
        # admission (kept across retractions, so resuming does not change what it samples).
        self.sampling_seed: int | None = None
        # Speculative decoding: the request's n-gram index, drafting policy and acceptance
        # counts (speculative/speculator.SpecState), from its first draft; None without.
        self.spec: Any | None = None

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def output_len(self) -> int:
        return self.seq_len - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.computed_len

    @property
    def remaining_tokens(self) -> int:
        """Tokens this request may still generate."""
        return self.max_seq_len - self.seq_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprob_pos is not None and self.prompt_logprob_pos < self.prompt_len - 1

    @property
    def prefix_match_limit(self) -> int:
        """How much of the sequence a prefix-cache hit may cover: at least one token is left to
        compute, and the positions whose prompt log-probabilities are still owed are computed
        (a cached token's KV is there, but not its logits)."""
        limit = self.seq_len - 1
        return min(limit, self.prompt_logprob_pos) if self.wants_prompt_logprobs else limit

    @property
    def cache_owned_len(self) -> int:
        return self.handle.prefix_len if self.handle is not None else 0

    @property
    def is_decoding(self) -> bool:
        return self.row is not None and self.extend_len == 1 and self.output_len > 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, seq_len={self.seq_len}, computed_len={self.computed_len}, "
                f"output_len={self.output_len}, row={self.row})")
