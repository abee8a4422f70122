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

The class is split by concern, as SGLang's is: forming a batch (admission.py), taking its
results (output_processor.py), failing a step (step_failures.py); this file holds the state,
intake, the loop body, launching a forward and sampling, and health.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from minisgl_mp.constrained.base import GrammarBackend, grammar_key, request_matcher
from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.engine.model_runner import ModelRunner
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.kvcache.base import create_prefix_cache
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.admission import INIT_NEW_TOKEN_RATIO, AdmissionMixin
from minisgl_mp.scheduler.batch import ScheduledBatch
from minisgl_mp.scheduler.cache_manager import CacheManager
from minisgl_mp.scheduler.faults import FaultPlan
from minisgl_mp.scheduler.output_processor import OutputProcessorMixin, ReqOutput
from minisgl_mp.scheduler.prefill_budget import MixedPrefillBudget
from minisgl_mp.scheduler.req import FinishReason, Req, TokenLogprobs
from minisgl_mp.scheduler.sampler import DeviceSample, SampleResult, Sampler, record_prompt_logprobs
from minisgl_mp.scheduler.step_failures import FatalSchedulerError, StepFailureMixin, is_device_fatal
from minisgl_mp.speculative.speculator import NgramSpeculator, Verified, rank0_verified
from minisgl_mp.utils.device import host_tensor

__all__ = ["FatalSchedulerError", "LaunchedStep", "ReqOutput", "Scheduler", "SchedulerStats", "is_device_fatal"]

logger = logging.getLogger(__name__)

# The first forwards pay one-time costs (kernels built and caches filled on first use): their
# times would mislead the prefill budget.
BUDGET_SKIP_FORWARDS = 2
# On the CPU a prompt token costs a step about what a decoding request does, so a step with a
# long prefill chunk stalls every decoding stream; on CUDA it mostly does not (and timing a step
# there would need a sync).
CPU_MIXED_STEP_RATIO = 2.0


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


class Scheduler(AdmissionMixin, OutputProcessorMixin, StepFailureMixin):
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
        # Under TP rank 0's tokens are broadcast: a sync anyway. With speculation a draft is
        # made from the request's tokens, which must all be read first: a step that drafts (or
        # follows a verification) waits for the one before; the others overlap (_needs_tokens).
        self.overlap = overlap and tp is None
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
        req.grammar = request_matcher(self.grammar, None, params) if key is None else None  # a thinking budget's
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
                req.grammar = request_matcher(self.grammar, fut.result(), req.params)
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
        if batch.verifies:  # reads the tokens back: a verification step does not overlap the next
            verified = self.speculator.verify(logits[num_sampled:num_sampled + num_verify], list(batch.verifies),
                                              self.sampler)
            if self.tp is not None:
                verified = rank0_verified(self.tp, list(batch.verifies), verified)
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
        req.computed_len += n
        if not sampled:  # a prompt chunk that goes on in a later step
            return
        if prefill and req.computed_len - req.cache_owned_len >= self.kv.page_size:
            self.kv.cache_prefix(req)
        req.token_ids.append(-(k + 1))

    def _complete(self, step: LaunchedStep) -> None:
        """Read the step's tokens back (the one sync of a step) and process them."""
        result = step.sample.resolve() if isinstance(step.sample, DeviceSample) else step.sample
        self._process(step, result)

    def _needs_tokens(self, prev: LaunchedStep) -> bool:
        """Whether the next step cannot be scheduled before `prev`'s tokens are read: a
        grammar must accept a token before it can mask the next, and a retraction must not
        send a request back to the queue with a token still unread (nor can a finished request
        that would free pages be told apart from one that goes on); a draft is read off its
        request's tokens, and a verification's tokens are taken only when it is processed."""
        if any(r.grammar is not None for r in prev.batch.sampled_reqs):
            return True
        decodes = [r for r in self.running if self._decodable(r)]
        if prev.batch.verifies or self._may_draft(decodes):
            return True
        pages = sum(self.kv.pages_for(r, 1) for r in decodes)
        return pages * self.kv.page_size > self.kv.available_tokens

    def _may_draft(self, decodes: list[Req]) -> bool:
        """Whether the next step could draft for one of `decodes` (speculative decoding)."""
        spec = self.speculator
        return spec is not None and spec.batch_drafts(len(decodes)) and any(spec.may_draft(r) for r in decodes)

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

    # ---- health and admin -------------------------------------------------------------------------
    def private_tokens(self) -> int:
        return sum(r.alloc_len - r.cache_owned_len for r in self.running)

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
        if self.speculator is not None:  # finished requests' text, which drafts for later ones
            self.speculator.shared.clear()
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
