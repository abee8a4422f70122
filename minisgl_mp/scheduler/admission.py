"""Forming each step's batch: the decodes (retracting when the KV pool cannot hold their next
tokens), the speculative drafts among them, and the prompt chunks of running and newly admitted
requests within the step's prefill budget.

Admission estimates future growth instead of reserving `max_tokens`: a request is assumed to
generate about `new_token_ratio` of what it may still generate (capped per request); the ratio
decays while nothing is retracted and jumps back up when something is. When decode runs out of
pages, the requests with the least generated so far are retracted and later resumed by
recomputation (their computed prefix stays in the prefix cache).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

import torch

from minisgl_mp.scheduler.batch import ScheduledBatch, build_batch
from minisgl_mp.scheduler.policy import InFlightPrefixes, order_waiting
from minisgl_mp.scheduler.req import Req
from minisgl_mp.utils.device import host_tensor

if TYPE_CHECKING:
    from minisgl_mp.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.002
ESTIMATE_CAP_TOKENS = 4096
# Waiting requests whose prompts count towards the prefill backlog (see MixedPrefillBudget).
BACKLOG_PEEK = 16
# A prompt whose log-probabilities are wanted prefills at most this many tokens a step: each
# goes through the LM head, and [tokens, vocab] float32 logits (plus their log_softmax) for a
# full 8192-token chunk of a 151,936-word vocabulary would take 10 GB.
PROMPT_LOGPROB_CHUNK = 512


def _chunk_len(req: Req, budget: int) -> int:
    """Prompt tokens of `req` to run this step, within the step's prefill budget."""
    return min(req.extend_len, budget, PROMPT_LOGPROB_CHUNK if req.wants_prompt_logprobs else budget)


class AdmissionMixin:
    """The Scheduler's batch forming (its state lives on the Scheduler)."""

    def _schedule(self: Scheduler) -> ScheduledBatch | None:
        decodes = [r for r in self.running if self._decodable(r)]
        prefill_work = any(not r.is_decoding for r in self.running) or bool(self.waiting)
        run_prefill = prefill_work and (
            self.config.mixed_batch or not decodes or self._prefill_streak < self.config.max_prefill_streak
        )
        run_decode = bool(decodes) and (self.config.mixed_batch or not run_prefill)
        decode_locs = None
        decodes_waiting = decodes
        verifies = []
        if run_decode:
            decodes, decode_locs = self._schedule_decode()
            if self.speculator is not None:
                decodes, decode_locs, verifies = self._schedule_drafts(decodes, decode_locs)
        else:
            decodes = []
        # Decodes left out of this step (no mixed batches) wait on it all the same.
        budget = self.prefill_budget.tokens(len(decodes) if run_decode else len(decodes_waiting),
                                            self._prefill_backlog() if self.prefill_budget.enabled else 0)
        prefills = self._schedule_prefill(budget) if run_prefill else []
        self._prefill_streak = self._prefill_streak + 1 if prefills else 0
        if not decodes and not prefills and not verifies:
            return None
        return build_batch(decodes, decode_locs, prefills, self.device, verifies)

    def _prefill_backlog(self: Scheduler) -> int:
        """Prompt tokens still to prefill: of the running requests, and of the first
        BACKLOG_PEEK waiting ones (a bound on the cost; a longer queue is a backlog anyway)."""
        running = sum(r.extend_len for r in self.running if not r.is_decoding)
        return running + sum(r.extend_len for r in itertools.islice(self.waiting, BACKLOG_PEEK))

    def _schedule_decode(self: Scheduler) -> tuple[list[Req], torch.Tensor | None]:
        """The decoding requests and the KV slot of each one's next token: one allocation and
        one page-table store for the whole group, after retracting until they all fit."""
        while True:
            decodes = [r for r in self.running if self._decodable(r)]
            pages = sum(self.kv.pages_for(r, 1) for r in decodes)
            if pages * self.kv.page_size <= self.kv.available_tokens or not decodes:
                break
            self._retract_one()
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if not decodes:
            return [], None
        self._step_reqs.extend(decodes)
        locs = self.kv.reserve_decodes(decodes)
        if locs is None:  # cannot happen after the check above
            raise RuntimeError(f"no KV slots for {len(decodes)} decoding requests after retraction")
        return decodes, locs

    def _schedule_drafts(self: Scheduler, decodes: list[Req], locs: torch.Tensor | None
                         ) -> tuple[list[Req], torch.Tensor | None, list[tuple[Req, list[int], torch.Tensor]]]:
        """Split the decodes into those that run a draft this step (each with the KV slots of
        its draft + 1 tokens; one that cannot get them decodes plainly) and the rest."""
        drafts = self.speculator.drafts(decodes)
        if not any(drafts):
            return decodes, locs, []
        plain, plain_rows, verifies = [], [], []
        for i, (req, draft) in enumerate(zip(decodes, drafts)):
            loc = self.kv.reserve(req, len(draft) + 1) if draft else None
            if loc is None:
                plain.append(req)
                plain_rows.append(i)
            else:
                verifies.append((req, draft, loc))
        plain_locs = locs[host_tensor(plain_rows, torch.int64, self.device)] if plain else None
        return plain, plain_locs, verifies

    def _retract_one(self: Scheduler) -> None:
        # Fewest generated tokens first (least work lost), then the longest (most memory back).
        self._retract(min(self.running, key=lambda r: (r.output_len, -r.seq_len)))

    def _retract(self: Scheduler, victim: Req) -> None:
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_retractions += 1
        victim.wait_start_round = self._prefill_rounds - self.config.schedule_aging_steps  # resumes first
        self.waiting.appendleft(victim)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, INIT_NEW_TOKEN_RATIO) + 0.1)
        logger.info("KV pool full: retracted %s (%d tokens generated), will resume later",
                    victim.rid, victim.output_len)

    def _future_tokens(self: Scheduler, req: Req) -> int:
        """Tokens `req` will still need beyond its current KV: the rest of its prompt plus an
        estimate of its output."""
        rest = max(0, req.seq_len - max(req.computed_len, req.alloc_len))
        return rest + int(min(req.remaining_tokens, ESTIMATE_CAP_TOKENS) * self.new_token_ratio)

    def _schedule_prefill(self: Scheduler, budget: int) -> list[tuple[Req, int, torch.Tensor]]:
        self._prefill_rounds += 1
        entries = []
        # Prompts already under way (chunked prefill, resumed requests) continue first.
        for r in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            n = _chunk_len(r, budget)
            self._step_reqs.append(r)
            loc = self.kv.reserve(r, n)
            if loc is None:
                # Out of pages mid-prompt: step back rather than hold KV that cannot grow. Its
                # computed prefix stays in the cache, so resuming usually recomputes little.
                self._retract(r)
                continue
            entries.append((r, n, loc))
            budget -= n
        if self.waiting and budget > 0:
            entries += self._admit_waiting(budget)
        return entries

    def _admit_waiting(self: Scheduler, budget: int) -> list[tuple[Req, int, torch.Tensor]]:
        """Start prefilling waiting requests in policy order while the budget, the running
        limit, the page-table rows and the KV pool allow. When none of these can take even one
        request, it returns before looking at the queue: a step costs the same with 10 or 10,000
        requests waiting."""
        if len(self.running) >= self.config.max_running_requests or not self.kv.table.num_free:
            return []
        reserved = sum(self._future_tokens(r) for r in self.running)
        if self.running and reserved >= self.kv.available_tokens:
            return []  # every waiting request needs at least one token of KV
        entries = []
        admitted: set[int] = set()
        ordered = order_waiting(self.waiting, self.config.schedule_policy, self.kv.cache,
                                self.config.schedule_aging_steps, self._prefill_rounds)
        in_flight = InFlightPrefixes(self.kv.cache) if self.config.cache_type == "radix" else None
        if in_flight is not None:
            for r in self.running:
                if not r.is_decoding:
                    in_flight.add(r)
        for r in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if in_flight is not None and in_flight.should_wait(r):
                continue
            if not self.kv.admit(r):
                break
            self._step_reqs.append(r)  # holds a row and a lock from here
            n = _chunk_len(r, budget)
            loc = None
            if self._future_tokens(r) + reserved <= self.kv.available_tokens or not self.running:
                loc = self.kv.reserve(r, n)
            if loc is None:
                self.kv.release(r, keep_in_cache=False)
                break
            reserved += self._future_tokens(r)
            if r.prefix_hit_len is None:
                r.prefix_hit_len = r.computed_len
            self.stats.cached_prompt_tokens += r.computed_len
            self.running.append(r)
            admitted.add(id(r))
            if in_flight is not None:
                in_flight.add(r)
            entries.append((r, n, loc))
            budget -= n
        self._drop_admitted(admitted)
        self.sampler.bind([r for r, _, _ in entries])
        return entries

    def _drop_admitted(self: Scheduler, admitted: set[int]) -> None:
        """Take the admitted requests out of the waiting queue: from its front (fcfs admits a
        prefix of it), rebuilding it only when some were admitted from further back."""
        while admitted and self.waiting and id(self.waiting[0]) in admitted:
            admitted.discard(id(self.waiting.popleft()))
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
