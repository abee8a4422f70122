"""Taking a step's tokens: each sampled or verified request's new tokens, its stop checks, its
output record, and the end of a request that finished (its KV to the prefix cache). A failure
while taking one request's tokens (its stop-string check, say) fails only that request."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minisgl_mp.scheduler.req import FinishReason, Req, TokenLogprobs
from minisgl_mp.scheduler.sampler import SampleResult
from minisgl_mp.speculative.speculator import Verified, release_rejected

if TYPE_CHECKING:
    from minisgl_mp.scheduler.scheduler import LaunchedStep, Scheduler

logger = logging.getLogger(__name__)


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


class OutputProcessorMixin:
    """The Scheduler's result processing (its state lives on the Scheduler)."""

    def _process(self: Scheduler, step: LaunchedStep, result: SampleResult | None) -> None:
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

    def _accept_verified(self: Scheduler, req: Req, v: Verified) -> None:
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
        req.computed_len += v.accepted + 1
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
        req.computed_len = min(req.computed_len, req.seq_len - 1 if not req.finished else req.seq_len)
        self.sampler.state.out_len[req.row] += len(new)
        lps = [lp for lp in v.logprobs[:len(new)] if lp is not None]
        self._pending_outputs.append(self._output(req, new, lps))
        if req.finished:
            self._finished(req)

    def _accept(self: Scheduler, req: Req, pos: int, token: int, lp: TokenLogprobs | None) -> None:
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
            req.computed_len = min(req.computed_len, req.seq_len)
        self._pending_outputs.append(self._output(req, [token], [lp] if lp is not None else [],
                                                  output_len=pos + 1 - req.prompt_len))
        if req.finished:
            self._finished(req)

    def _finished(self: Scheduler, req: Req) -> None:
        """`req` ended by a stop or a limit: its KV goes to the prefix cache (or back)."""
        self.running.remove(req)
        self.kv.release(req)
        del self.reqs[req.rid]
        self.stats.finished += 1
        if self.speculator is not None:
            self.speculator.finished(req)

    def _check_finished(self: Scheduler, req: Req, token: int, seq_len: int) -> None:
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

    def _output(self: Scheduler, req: Req, new_ids: list[int], lps: list[TokenLogprobs],
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
