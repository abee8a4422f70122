"""Continuous batching over the paged KV pool and the prefix cache.

One call to `step()` reads aloud: schedule -> forward -> sample -> process results.
Requests join and leave between steps. Decodes run in every step (with a prefill chunk beside
them when `mixed_batch` is on), prefill chunks are bounded by `max_prefill_tokens`, admission
estimates future growth instead of reserving `max_tokens`, and when decode runs out of pages the
requests with the least generated so far are retracted and later resumed by recomputation.

A step that raises fails the requests it was running, not the scheduler: they end with an error
output, their KV is released and the page accounting is checked before the next step. A failure
that belongs to one request (its sampling, its stop check) fails only that request. What cannot
be recovered from (a broken page accounting, a device error, the same failure step after step)
is raised out of `step()` as `FatalSchedulerError`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from minisgl_mp.constrained.base import GrammarBackend, grammar_key
from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.engine.model_runner import ModelRunner
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.kvcache.base import create_prefix_cache
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.batch import ScheduledBatch, build_batch
from minisgl_mp.scheduler.cache_manager import CacheManager
from minisgl_mp.scheduler.faults import FaultPlan
from minisgl_mp.scheduler.prefill_budget import MixedPrefillBudget
from minisgl_mp.scheduler.policy import InFlightPrefixes, order_waiting
from minisgl_mp.scheduler.req import FinishReason, Req, TokenLogprobs
from minisgl_mp.scheduler.sampler import DeviceSample, SampleResult, Sampler, record_prompt_logprobs
from minisgl_mp.speculative.speculator import NgramSpeculator, Verified, release_rejected
from minisgl_mp.utils.device import host_tensor

logger = logging.getLogger(__name__)

# Admission assumes a request generates about `ratio` of what it may still generate (capped
# per request); the ratio decays while nothing is retracted and jumps back up when something is.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.002
ESTIMATE_CAP_TOKENS = 4096
# The first forwards pay one-time costs (kernels built and caches filled on first use): their
# times would mislead the prefill budget.
BUDGET_SKIP_FORWARDS = 2
# On the CPU a prompt token costs a step about what a decoding request does, so a step with a
# long prefill chunk stalls every decoding stream; on CUDA it mostly does not (and timing a step
# there would need a sync).
CPU_MIXED_STEP_RATIO = 2.0
# Waiting requests whose prompts count towards the prefill backlog (see MixedPrefillBudget).
BACKLOG_PEEK = 16
# A step-level failure repeated this many steps in a row means the engine itself is broken.
MAX_REPEATED_FAILURES = 3


class FatalSchedulerError(RuntimeError):
    """The scheduler cannot go on serving; the process should exit with this message."""


def is_device_fatal(e: BaseException) -> bool:
    """Errors after which the device's state cannot be trusted (CUDA's sticky errors). Running
    out of memory is not one of them: the batch fails and memory comes back."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    text = f"{type(e).__name__}: {e}"
    return any(s in text for s in ("AcceleratorError", "CUDA error", "device-side assert", "illegal memory access"))


# A prompt whose log-probabilities are wanted prefills at most this many tokens a step: each
# goes through the LM head, and [tokens, vocab] float32 logits (plus their log_softmax) for a
# full 8192-token chunk of a 151,936-word vocabulary would take 10 GB.
PROMPT_LOGPROB_CHUNK = 512
# With nothing to run but grammars compiling, a step waits this long for one to finish
# rather than spin.
GRAMMAR_WAIT_S = 0.01
NO_GRAMMAR_BACKEND = ("structured output (json_schema, regex, ebnf, response_format) is off: "
                      "this server runs with --grammar-backend none")


@dataclass
class LaunchedStep:
    """A forward that has run (or, on a GPU, been queued) and been sampled, whose tokens the
    host has not read yet. Each sampled request holds a placeholder at `positions[k]` of its
    token ids: -(k + 1), where k is its row in `sample`."""

    batch: ScheduledBatch
    sample: DeviceSample | SampleResult | None
    positions: list[int]  # per sampled request
    verified: list[Verified] = field(default_factory=list)  # per entry of batch.verifies


@dataclass(frozen=True)
class ReqOutput:
    """What one step produced for one request."""

    rid: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # set when the request failed; `finished` is then True
    error_kind: str = "internal"  # "invalid_request": the request's fault (its grammar), a 400
    # With the first output only: the prompt's log-probabilities, when asked for.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Speculative decoding, so far: the request's verification steps and the drafts they accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens actually run through the model as prefill
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    retractions: int = 0
    finished: int = 0
    aborted: int = 0
    failed_requests: int = 0
    failed_steps: int = 0
    spec_verify_steps: int = 0  # speculative decoding: requests' verification steps,
    spec_drafted_tokens: int = 0  # the draft tokens they checked,
    spec_accepted_tokens: int = 0  # and those accepted
    extra: dict[str, Any] = field(default_factory=dict)


def _chunk_len(req: Req, budget: int) -> int:
    """Prompt tokens of `req` to run this step, within the step's prefill budget."""
    return min(req.extend_len, budget, PROMPT_LOGPROB_CHUNK if req.wants_prompt_logprobs else budget)


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner, eos_ids: frozenset[int],
                 make_stop_checker: Callable[[Req], Any] | None = None, faults: FaultPlan | None = None,
                 grammar: GrammarBackend | None = None, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp
        self.runner = runner
        self.device = runner.device
        self.context_len = runner.context_len
        self.eos_ids = eos_ids
        self.make_stop_checker = make_stop_checker
        allocator = PageAllocator(runner.num_pages, config.page_size, self.device)
        cache = create_prefix_cache(config.cache_type, config.page_size, self.device)
        self.kv = CacheManager(allocator, cache, runner.req_table)
        self.grammar = grammar
        self.sampler = Sampler(runner.model_config.vocab_size, self.device, runner.req_table.table.shape[0],
                               config.seed, grammar)
        self.waiting: deque[Req] = deque()
        # Requests whose grammar is still compiling, in arrival order; they join `waiting` when it is done.
        self.grammar_queue: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.stats = SchedulerStats()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._prefill_streak = 0
        ratio = config.mixed_step_ratio
        if ratio is None:
            ratio = CPU_MIXED_STEP_RATIO if self.device.type == "cpu" else 0.0
        self.prefill_budget = MixedPrefillBudget(ratio, config.prefill_chunk(self.device.type))
        self._prefill_rounds = 0  # calls of _schedule_prefill: the clock of Req.wait_start_round
        self._pending_outputs: list[ReqOutput] = []
        self.faults = faults or FaultPlan()
        self._forwards = 0  # model forwards so far (the fault plan's step numbers)
        # Requests the current step has scheduled so far: the ones a failure while scheduling fails.
        self._step_reqs: list[Req] = []
        self._failure_streak: tuple[str, int] = ("", 0)  # (failure, consecutive steps)
        self._failed_this_step = False
        # Overlap scheduling: the step launched last, read back only after the next is launched.
        overlap = config.disable_overlap_schedule is False or (
            config.disable_overlap_schedule is None and self.device.type == "cuda")
        self.speculator = None
        if config.speculative_algorithm is not None:
            self.speculator = NgramSpeculator(config.speculative_num_draft_tokens,
                                              config.speculative_ngram_min_match_window_size,
                                              config.speculative_ngram_max_match_window_size,
                                              config.speculative_max_batch_tokens)
        # Under TP rank 0's tokens are broadcast: a sync anyway. A draft is made from the
        # request's tokens, which must all be read first.
        self.overlap = overlap and tp is None and self.speculator is None
        self._inflight: LaunchedStep | None = None

    # ---- intake -----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError (naming what is wrong) for one that cannot run."""
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.runner.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context length is {self.context_len}, "
                "which must leave room for at least one generated token"
            )
        pool_tokens = self.kv.allocator.num_slots
        if len(prompt_ids) >= pool_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the KV pool holds only {pool_tokens}")
        key = grammar_key(params)
        if key is not None:
            if self.grammar is None:
                raise ValueError(NO_GRAMMAR_BACKEND)
            self.grammar.validate(key)
        max_seq_len = min(self.context_len, len(prompt_ids) + params.max_tokens, pool_tokens)
        req = Req(rid, prompt_ids, params, max_seq_len, self.eos_ids)
        if params.stop and self.make_stop_checker is not None:
            req.stop_checker = self.make_stop_checker(req)
        self.reqs[rid] = req
        if key is None:
            self._enqueue(req)
        else:
            req.grammar_future = self.grammar.compile(key)
            if self.tp is not None:
                # Every rank must admit it in the same step, and compile times differ between
                # processes: under TP the compile is waited for here, before the next step.
                wait([req.grammar_future])
            self.grammar_queue.append(req)

    def _enqueue(self, req: Req) -> None:
        req.wait_start_round = self._prefill_rounds
        self.waiting.append(req)

    def check_grammar(self, params: SamplingParams) -> None:
        """Raise ValueError if `params`' grammar is invalid (or there is no grammar backend), and
        start compiling a valid one, so the request that follows finds it ready."""
        key = grammar_key(params)
        if key is None:
            return
        if self.grammar is None:
            raise ValueError(NO_GRAMMAR_BACKEND)
        self.grammar.validate(key)
        self.grammar.compile(key)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready to the waiting queue; a grammar that failed to
        compile ends its request with an invalid_request error."""
        for req in [r for r in self.grammar_queue if r.grammar_future.done()]:
            self.grammar_queue.remove(req)
            fut, req.grammar_future = req.grammar_future, None
            err = fut.exception()
            if err is None:
                req.grammar = self.grammar.matcher(fut.result())
                self._enqueue(req)
                continue
            req.finish_reason = FinishReason.ABORT
            del self.reqs[req.rid]
            message = str(err) if isinstance(err, ValueError) else f"the grammar failed to compile: {err!r}"
            self._pending_outputs.append(replace(self._output(req, [], []), error=message,
                                                 error_kind="invalid_request"))

    def abort(self, rid: str) -> bool:
        """Stop a request wherever it is, freeing its KV. False if the id is unknown."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.grammar_queue:
            self.grammar_queue.remove(req)  # its compile goes on: the grammar is cached for others
        else:
            self.waiting.remove(req)
        req.finish_reason = FinishReason.ABORT
        self.stats.aborted += 1
        self._pending_outputs.append(self._output(req, [], []))
        del self.reqs[rid]
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs or self.grammar_queue
                    or self._inflight is not None)

    # ---- the loop body --------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Without overlap: schedule, run, sample and process one batch. With overlap: schedule
        and launch the next batch first, then read back and process the one launched by the
        previous call, so the host's work for step N+1 runs while the device computes step N.
        Its decodes take their input tokens straight from step N's sampled tokens on the device."""
        self._step_reqs = []
        self._failed_this_step = False
        prev, self._inflight = self._inflight, None
        batch = launched = None
        try:
            if self.grammar_queue:
                self._admit_compiled()
            if prev is not None and self._needs_tokens(prev):
                prev, done = None, prev
                self._complete(done)
            batch = self._schedule()
            if batch is not None:
                launched = self._launch(batch, prev)
                if not self.overlap:
                    launched, done = None, launched
                    self._complete(done)
                self._failure_streak = ("", 0)
        except FatalSchedulerError:
            raise
        except Exception as e:  # noqa: BLE001 - one failed step costs its requests, not the server
            if prev is not None:  # what the step before computed still goes out first
                prev, done = None, prev
                self._complete_or_fail(done)
            self._fail_step(e, batch.reqs if batch is not None else self._step_reqs)
        if prev is not None:
            self._complete_or_fail(prev)
        self._inflight = launched
        if batch is None and self.grammar_queue and not self._pending_outputs:
            wait([r.grammar_future for r in self.grammar_queue], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        if self._failed_this_step:
            self._check_after_failure()
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ---- failures -----------------------------------------------------------------------------
    def _fail_step(self, e: Exception, reqs: list[Req]) -> None:
        """Fail the step's requests: its batch, or (if scheduling itself raised) those it had
        touched so far."""
        what = f"{type(e).__name__}: {e}"
        if is_device_fatal(e):
            raise FatalSchedulerError(f"unrecoverable device error: {what}") from e
        if self.tp is not None:
            # A rank that failed alone (or a rank that is gone) has left the others inside a
            # collective of this step: there is no step boundary left to recover at.
            raise FatalSchedulerError(f"a step failed on tensor-parallel rank {self.tp.rank}: {what}") from e
        last, count = self._failure_streak
        count = count + 1 if what == last else 1
        self._failure_streak = (what, count)
        self.stats.failed_steps += 1
        victims = list(dict.fromkeys(r for r in reqs if not r.finished))
        logger.exception("a scheduler step failed; failing its %d request(s)", len(victims))
        if count >= MAX_REPEATED_FAILURES:
            raise FatalSchedulerError(f"the same failure in {count} steps in a row: {what}") from e
        for r in victims:
            self._fail(r, f"internal error while running the batch: {what}")

    def _fail(self, req: Req, message: str) -> None:
        """End `req` with an error: out of the queues, its KV released (nothing it computed goes
        into the prefix cache: this step's writes may be partial)."""
        self._failed_this_step = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.grammar_queue:
            self.grammar_queue.remove(req)
        try:
            self.kv.release(req, keep_in_cache=False)
        except Exception:  # noqa: BLE001 - the accounting check that follows names any leak
            logger.exception("releasing the KV of failed request %s", req.rid)
        req.finish_reason = FinishReason.ABORT
        self.reqs.pop(req.rid, None)
        self.stats.failed_requests += 1
        self._pending_outputs.append(replace(self._output(req, [], []), error=message))

    def _check_after_failure(self) -> None:
        try:
            self.check_health(full=True)
        except Exception as e:  # noqa: BLE001 - any inconsistency is fatal here
            raise FatalSchedulerError(f"KV accounting broken after a failed step: {e}") from e

    # ---- launching and completing a step ------------------------------------------------------
    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Run (or queue) the forward and the sampling of `batch`, and advance the host's
        bookkeeping as far as it goes without the sampled tokens."""
        self._forwards += 1
        self.faults.before("forward", self._forwards)
        t0 = time.perf_counter()
        input_ids = batch.input_ids
        if batch.has_futures:  # decodes whose input is a token of `prev`, still on the device
            input_ids = torch.where(input_ids < 0, _token_tensor(prev.sample, self.device)[(-input_ids - 1).clamp(min=0)],
                                    input_ids)
        logits = self.runner.forward(batch.layout, input_ids, batch.positions, batch.logits_indices)
        num_sampled, num_verify = len(batch.sampled_reqs), batch.num_verify_rows
        if batch.prompt_logprob_spans:
            record_prompt_logprobs(batch.prompt_logprob_spans, logits[num_sampled + num_verify:])
        sample = self._sample(logits[:num_sampled], batch.sampled_reqs)
        verified = []
        if batch.verifies:  # reads the tokens back: speculative steps run without overlap
            verified = self.speculator.verify(logits[num_sampled:num_sampled + num_verify], list(batch.verifies),
                                              self.sampler)
        self._observe_step(batch, time.perf_counter() - t0)
        positions = []
        verifying = {id(r) for r, _ in batch.verifies}
        for req, n, sampled, prefill in zip(batch.reqs, batch.extend_lens, batch.sampled, batch.prefill):
            if not req.finished and id(req) not in verifying:  # (failed while sampling)
                self._advance(req, n, prefill, sampled, len(positions))
            if sampled:
                positions.append(req.seq_len - 1)
        return LaunchedStep(batch, sample, positions, verified)

    def _advance(self, req: Req, n: int, prefill: bool, sampled: bool, k: int) -> None:
        """`req` has run `n` more tokens; if it was sampled, its token is the k-th of the step
        and a placeholder holds its place until it is read."""
        req.cached_len += n
        if not sampled:  # a prompt chunk that goes on in a later step
            return
        if prefill and req.cached_len - req.cache_len >= self.kv.page_size:
            self.kv.cache_prefix(req)
        req.token_ids.append(-(k + 1))

    def _complete(self, step: LaunchedStep) -> None:
        """Read the step's tokens back (the one sync of a step) and process them."""
        result = step.sample.resolve() if isinstance(step.sample, DeviceSample) else step.sample
        self._process(step, result)

    def _complete_or_fail(self, step: LaunchedStep) -> None:
        try:
            self._complete(step)
        except FatalSchedulerError:
            raise
        except Exception as e:  # noqa: BLE001 - as for a step that fails to run
            self._fail_step(e, step.batch.reqs)

    def _needs_tokens(self, prev: LaunchedStep) -> bool:
        """Whether the next step cannot be scheduled before `prev`'s tokens are read: a
        grammar must accept a token before it can mask the next, and a retraction must not
        send a request back to the queue with a token still unread (nor can a finished request
        that would free pages be told apart from one that goes on)."""
        if any(r.grammar is not None for r in prev.batch.sampled_reqs):
            return True
        pages = sum(self.kv.pages_for(r, 1) for r in self.running if self._decodable(r))
        return pages * self.kv.page_size > self.kv.available_tokens

    @staticmethod
    def _decodable(req: Req) -> bool:
        # A request whose unread token is its last allowed one ends when it is read: no step
        # is launched for it (one whose unread token is a stop token costs one step, discarded).
        return req.is_decoding and req.seq_len < req.max_seq_len

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> DeviceSample | SampleResult | None:
        result = self._sample_local(logits, reqs)
        if result is None or self.tp is None:
            return result
        result = result.resolve() if isinstance(result, DeviceSample) else result
        # Every rank sampled the same all-gathered logits with the same generator; rank 0's
        # tokens are the ones every rank appends, so the ranks cannot part ways.
        ids = self.tp.broadcast_ints([-1 if t is None else t for t in result.token_ids])
        return SampleResult([None if t < 0 else t for t in ids], result.logprobs)

    def _sample_local(self, logits: torch.Tensor, reqs: list[Req]) -> DeviceSample | SampleResult | None:
        """Sample the batch, its tokens left on the device (their copy to the host queued); if
        that raises, sample each request alone and fail only those whose own sampling fails
        (their constraints), with None in their place."""
        if not reqs:
            return None
        try:
            self.faults.before("sample", self._forwards)
            sample = self.sampler.sample(logits, reqs)
            sample.start_copy()
            return sample
        except Exception:  # noqa: BLE001 - narrowed down to the requests that cause it below
            logger.exception("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
        token_ids: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        for i, r in enumerate(reqs):
            try:
                one = self.sampler.sample(logits[i : i + 1], [r]).resolve()
                token_ids.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            except Exception as e:  # noqa: BLE001 - this request's own failure
                token_ids.append(None)
                logprobs.append(None)
                self._fail(r, f"sampling failed: {type(e).__name__}: {e}")
        return SampleResult(token_ids, logprobs)

    def _observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        if not self.prefill_budget.enabled or self._forwards <= BUDGET_SKIP_FORWARDS:
            return
        if self.tp is not None:
            # Each rank times its own step, but all must choose the same budget (the same
            # batch): rank 0's time is everyone's.
            seconds = self.tp.broadcast_ints([int(seconds * 1e6)])[0] / 1e6
        num_decodes = len(batch.reqs) - sum(batch.prefill)
        self.prefill_budget.observe(seconds, num_decodes, batch.num_prefill_tokens)

    def _schedule(self) -> ScheduledBatch | None:
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

    def _prefill_backlog(self) -> int:
        """Prompt tokens still to prefill: of the running requests, and of the first
        BACKLOG_PEEK waiting ones (a bound on the cost; a longer queue is a backlog anyway)."""
        running = sum(r.extend_len for r in self.running if not r.is_decoding)
        return running + sum(r.extend_len for r in itertools.islice(self.waiting, BACKLOG_PEEK))

    def _schedule_decode(self) -> tuple[list[Req], torch.Tensor | None]:
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

    def _schedule_drafts(self, decodes: list[Req], locs: torch.Tensor | None
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

    def _retract_one(self) -> None:
        # Fewest generated tokens first (least work lost), then the longest (most memory back).
        self._retract(min(self.running, key=lambda r: (r.output_len, -r.seq_len)))

    def _retract(self, victim: Req) -> None:
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_retractions += 1
        victim.wait_start_round = self._prefill_rounds - self.config.schedule_aging_steps  # resumes first
        self.waiting.appendleft(victim)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, INIT_NEW_TOKEN_RATIO) + 0.1)
        logger.info("KV pool full: retracted %s (%d tokens generated), will resume later",
                    victim.rid, victim.output_len)

    def _future_tokens(self, req: Req) -> int:
        """Tokens `req` will still need beyond its current KV: the rest of its prompt plus an
        estimate of its output."""
        rest = max(0, req.seq_len - max(req.cached_len, req.alloc_len))
        return rest + int(min(req.remaining_tokens, ESTIMATE_CAP_TOKENS) * self.new_token_ratio)

    def _schedule_prefill(self, budget: int) -> list[tuple[Req, int, torch.Tensor]]:
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

    def _admit_waiting(self, budget: int) -> list[tuple[Req, int, torch.Tensor]]:
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
                r.prefix_hit_len = r.cached_len
            self.stats.cached_prompt_tokens += r.cached_len
            self.running.append(r)
            admitted.add(id(r))
            if in_flight is not None:
                in_flight.add(r)
            entries.append((r, n, loc))
            budget -= n
        self._drop_admitted(admitted)
        self.sampler.bind([r for r, _, _ in entries])
        return entries

    def _drop_admitted(self, admitted: set[int]) -> None:
        """Take the admitted requests out of the waiting queue: from its front (fcfs admits a
        prefix of it), rebuilding it only when some were admitted from further back."""
        while admitted and self.waiting and id(self.waiting[0]) in admitted:
            admitted.discard(id(self.waiting.popleft()))
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)

    def _process(self, step: LaunchedStep, result: SampleResult | None) -> None:
        batch = step.batch
        self.stats.steps += 1
        self.stats.prefill_tokens += batch.num_prefill_tokens
        # Generated tokens: a verified request's count when its verification is taken (below),
        # not the rows it ran (its rejected drafts are not output).
        self.stats.decode_tokens += sum(n for n, p in zip(batch.extend_lens, batch.prefill) if not p) - batch.num_verify_rows
        for k, req in enumerate(batch.sampled_reqs):
            if req.finished:  # failed while sampling, aborted, or ended by an earlier token
                continue
            try:
                self._accept(req, step.positions[k], result.token_ids[k], result.logprobs[k])
            except Exception as e:  # noqa: BLE001 - e.g. its stop-string check: only this request fails
                logger.exception("processing the output of %s failed", req.rid)
                self._fail(req, f"internal error while processing its output: {type(e).__name__}: {e}")
        for (req, _), v in zip(batch.verifies, step.verified):
            if req.finished:
                continue
            try:
                self._accept_verified(req, v)
            except Exception as e:  # noqa: BLE001 - as for a sampled request
                logger.exception("processing the output of %s failed", req.rid)
                self._fail(req, f"internal error while processing its output: {type(e).__name__}: {e}")

    def _accept_verified(self, req: Req, v: Verified) -> None:
        """A verification step's tokens for `req`: the KV of its last token and its accepted
        drafts is kept (the rejected drafts' pages go back to the pool), then each new token is
        taken as a decode's would be, up to the first that ends the request."""
        st = req.spec
        st.verify_steps += 1
        st.drafted_tokens += v.drafted
        st.accepted_tokens += v.accepted
        st.policy.record(v.drafted, v.accepted)
        self.stats.spec_verify_steps += 1
        self.stats.spec_drafted_tokens += v.drafted
        self.stats.spec_accepted_tokens += v.accepted
        req.cached_len += v.accepted + 1
        release_rejected(req, self.kv.table.table, self.kv.allocator)
        start = req.seq_len
        for token, lp in zip(v.tokens, v.logprobs):
            req.token_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            self._check_finished(req, token, req.seq_len)
            if req.finished:
                break
        new = req.token_ids[start:]
        self.stats.decode_tokens += len(new)
        req.cached_len = min(req.cached_len, req.seq_len - 1 if not req.finished else req.seq_len)
        self.sampler.state.out_len[req.row] += len(new)
        lps = [lp for lp in v.logprobs[:len(new)] if lp is not None]
        self._pending_outputs.append(self._output(req, new, lps))
        if req.finished:
            self._finished(req)

    def _accept(self, req: Req, pos: int, token: int, lp: TokenLogprobs | None) -> None:
        """The token sampled for position `pos` of `req` (its placeholder until now)."""
        req.token_ids[pos] = token
        if lp is not None:
            req.logprobs.append(lp)
        if req.grammar is not None and not req.grammar.accept_token(token):
            raise RuntimeError(f"the grammar does not allow the sampled token {token}")
        self._check_finished(req, token, pos + 1)
        if req.finished and req.seq_len > pos + 1:
            # A step launched after this token's had already run the request on: its token is
            # dropped (its KV, of this token, is valid and may be cached).
            del req.token_ids[pos + 1 :]
            req.cached_len = min(req.cached_len, req.seq_len)
        self._pending_outputs.append(self._output(req, [token], [lp] if lp is not None else [],
                                                  output_len=pos + 1 - req.prompt_len))
        if req.finished:
            self._finished(req)

    def _finished(self, req: Req) -> None:
        """`req` ended by a stop or a limit: its KV goes to the prefix cache (or back)."""
        self.running.remove(req)
        self.kv.release(req)
        del self.reqs[req.rid]
        self.stats.finished += 1
        if self.speculator is not None:
            self.speculator.finished(req)

    def _check_finished(self, req: Req, token: int, seq_len: int) -> None:
        """Whether `token`, ending the first `seq_len` tokens of `req`, ends it."""
        past_min = seq_len - req.prompt_len >= req.params.min_tokens
        if token in req.stop_ids and past_min:
            req.finish_reason, req.matched_stop = FinishReason.STOP, token
        elif req.grammar is not None and req.grammar.is_terminated():
            # The grammar ended on its stop token (with ignore_eos, that token is not in stop_ids).
            req.finish_reason, req.matched_stop = FinishReason.STOP, token
        elif req.stop_checker is not None:
            req.stop_checker.push([token])
            if req.stop_checker.matched_stop is not None:
                req.finish_reason, req.matched_stop = FinishReason.STOP, req.stop_checker.matched_stop
        if req.finish_reason is None and seq_len >= req.max_seq_len:
            req.finish_reason = FinishReason.LENGTH

    def _output(self, req: Req, new_ids: list[int], lps: list[TokenLogprobs],
                output_len: int | None = None) -> ReqOutput:
        prompt_lps, req.prompt_logprobs = req.prompt_logprobs, []
        return ReqOutput(
            rid=req.rid, new_token_ids=new_ids, logprobs=lps, finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            matched_stop=req.matched_stop, prompt_tokens=req.prompt_len,
            completion_tokens=req.output_len if output_len is None else output_len, cached_tokens=req.prefix_hit_len or 0,
            prompt_logprobs=prompt_lps, spec_verify_ct=req.spec.verify_steps if req.spec is not None else 0,
            spec_accepted_tokens=req.spec.accepted_tokens if req.spec is not None else 0,
        )

    # ---- health and admin -------------------------------------------------------------------------
    def private_tokens(self) -> int:
        return sum(r.alloc_len - r.cache_len for r in self.running)

    def check_health(self, full: bool = True) -> None:
        """Raises if any KV slot is unaccounted for; `full` also recounts the prefix cache's
        every invariant (a tree walk: ~0.1 s per 10k nodes)."""
        self.kv.check_health(self.private_tokens(), full=full)
        if not self.running and self.kv.cache.size_info.protected_tokens:
            raise RuntimeError(
                f"idle, yet {self.kv.cache.size_info.protected_tokens} cached tokens are still locked"
            )

    def flush_cache(self) -> int:
        if self.running or self.waiting:
            raise RuntimeError(f"cannot flush the cache while {len(self.running) + len(self.waiting)} requests run")
        return self.kv.flush()

    def engine_stats(self) -> dict[str, Any]:
        s = self.stats
        return {
            **self.kv.stats(),
            "running": len(self.running), "waiting": len(self.waiting),
            "max_prefill_tokens": self.prefill_budget.max_tokens,
            "grammar_waiting": len(self.grammar_queue),
            "grammar_cached": self.grammar.num_cached if self.grammar else 0,
            "grammar_cache_hits": self.grammar.cache_hits if self.grammar else 0,
            "steps": s.steps, "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens, "retractions": s.retractions,
            "finished": s.finished, "aborted": s.aborted,
            "failed_requests": s.failed_requests, "failed_steps": s.failed_steps,
            "spec_verify_steps": s.spec_verify_steps, "spec_drafted_tokens": s.spec_drafted_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_accept_length": ((s.spec_accepted_tokens + s.spec_verify_steps) / s.spec_verify_steps
                                   if s.spec_verify_steps else 0.0),
        }


def _token_tensor(sample: DeviceSample | SampleResult | None, device: torch.device) -> torch.Tensor:
    """A launched step's sampled tokens on the device (failed rows read as 0: their requests
    have ended and are in no later batch)."""
    if isinstance(sample, DeviceSample):
        return sample.token_ids
    return host_tensor([0 if t is None else t for t in sample.token_ids], torch.int64, device)
