"""The tokenizer process's core: turns requests into token ids for the scheduler and routes
every output that comes back (through the detokenizer) to the request that asked for it.

`generate()` is an async iterator of outputs. Whoever stops iterating early (a client that went
away, a cancelled task) aborts the request, so the scheduler frees its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl_mp.message.messages import (
    AbortReq, AdminReply, AdminReq, BatchTextOut, CheckGrammarReq, GenerateReq, ReqError, TextOut,
)
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.server.metrics import Metrics
from minisgl_mp.server_config import ServerConfig
from minisgl_mp.tokenizer.dispatch import Queue, ReplicaDispatcher
from minisgl_mp.tokenizer.requests import GenerateRequest, RequestError

logger = logging.getLogger("minisgl_mp.tokenizer")

# Texts longer than this are tokenized in a worker thread so the event loop keeps serving.
INLINE_TOKENIZE_CHARS = 20_000
# Retry-After (seconds) on a 503: a draining server is going away (a router retries elsewhere);
# a full queue drains quickly.
SHUTDOWN_RETRY_AFTER_S = 5
OVERLOADED_RETRY_AFTER_S = 1
# The scheduler answers a grammar check between two steps.
GRAMMAR_CHECK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _Failed:
    """A request's on_output callback raised this; its task re-raises it."""

    error: Exception


@dataclass
class _ReqState:
    queue: asyncio.Queue[TextOut | ReqError | _Failed] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    last_output: float | None = None
    submitted: bool = False  # sent (or being sent) to the scheduler: leaving early must abort it
    abort_sent: bool = False  # by abort_all (shutdown)
    finished: bool = False
    probe: bool = False  # a health probe: not a user request, not in the metrics
    # Takes each unfinished output as the detokenizer's batch is routed, instead of the queue:
    # a streaming client is then served by the routing loop, one pass per step, rather than by
    # waking its request's task once per step. What it raises ends the request (see generate).
    on_output: Callable[[TextOut], None] | None = None


class TokenizerManager:
    """`to_schedulers`: one queue per scheduler replica (--dp-size)."""

    def __init__(self, config: ServerConfig, tokenizer: Any, to_schedulers: list[Queue], from_detokenizer: Any,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = ReplicaDispatcher(to_schedulers)
        self.from_detokenizer = from_detokenizer
        self.metrics = metrics
        self.context_len = config.model.context_len
        self.vocab_size = config.model.vocab_size
        self.states: dict[str, _ReqState] = {}
        self._admin_waiters: dict[str, asyncio.Future[AdminReply]] = {}
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._batch_end: list[Callable[[], None]] = []
        self.stopping = False

    def on_batch_end(self, hook: Callable[[], None]) -> None:
        """Call `hook` once each batch of outputs (one scheduler step's) has been routed: a
        frontend that buffered what its on_output callbacks were given sends it then, one
        message per client rather than one per stream. It runs before any request's task
        wakes, so a request's last output always follows its earlier ones."""
        self._batch_end.append(hook)

    def fail(self, rid: str, error: Exception) -> None:
        """End a request from outside its task (a reply that could not be delivered): its
        task raises `error`, which aborts it."""
        state = self.states.get(rid)
        if state is not None:
            state.on_output = None
            state.queue.put_nowait(_Failed(error))

    def fail_all(self, error: Exception) -> int:
        """End every request still open with `error` (the server is stopping and no more
        outputs will come): each one's client gets it as its reply instead of waiting."""
        open_rids = [rid for rid, state in self.states.items() if not state.finished]
        for rid in open_rids:
            self.fail(rid, error)
        return len(open_rids)

    async def close(self, grace: float) -> None:
        """Let background sends (aborts, admin replies) finish for up to `grace` seconds, then
        cancel the rest, so none of them runs after the sockets close."""
        await finish_or_cancel(list(self._tasks), grace)

    async def run_dispatch(self) -> None:
        """Route outputs from the detokenizer until cancelled."""
        while True:
            msg = await self.from_detokenizer.get()
            if isinstance(msg, BatchTextOut):
                for out in msg.outputs:
                    self._route(out.rid, out)
                for hook in self._batch_end:
                    hook()
            elif isinstance(msg, ReqError):
                self._route(msg.rid, msg)
            elif isinstance(msg, AdminReply):
                fut = self._admin_waiters.pop(msg.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _route(self, rid: str, msg: TextOut | ReqError) -> None:
        state = self.states.get(rid)
        if state is None:  # the client went away and the request was aborted
            return
        if state.on_output is not None and isinstance(msg, TextOut) and not msg.finished:
            try:
                if not state.probe:
                    self._observe(state, msg)
                state.on_output(msg)
            except Exception as e:  # noqa: BLE001 - raised in the request's own task, which aborts it
                self.fail(rid, e)
            return
        state.queue.put_nowait(msg)

    # ---- tokenization ----------------------------------------------------------------------------
    async def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.params.constrained:
            await self.check_grammar(req.params)
        bad_stop = next((t for t in req.params.stop_token_ids if t >= self.vocab_size), None)
        if bad_stop is not None:
            raise RequestError(f"stop_token_ids: token id {bad_stop} is outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
        if req.input_ids is not None:
            ids = req.input_ids
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="input_ids")
        elif req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(req.messages, tools=req.tools, tokenize=False,
                                                          add_generation_prompt=True, **(req.chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise RequestError(f"messages cannot be rendered by the chat template: {e}", param="messages") from None
            ids = await self._encode(text, add_special_tokens=False)
        else:
            ids = await self._encode(req.text or "", add_special_tokens=True)
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed", param="prompt")
        bad = next((t for t, _ in req.params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="logit_bias")
        self.check_length(len(ids), req.params.max_tokens)
        return ids

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens >= self.context_len:
            raise RequestError(
                f"the prompt has {prompt_tokens} tokens, but the context length is {self.context_len} "
                "(prompt plus at least one generated token must fit)", param="prompt")
        if prompt_tokens + max_tokens > self.context_len:
            raise RequestError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_tokens + max_tokens} tokens, over the context length of {self.context_len}",
                param="max_tokens")

    # ---- requests ----------------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    def admit_check(self, extra: int = 1) -> None:
        if self.stopping:
            raise RequestError("the server is shutting down and takes no new requests", kind="unavailable",
                               retry_after=SHUTDOWN_RETRY_AFTER_S)
        if len(self.states) + extra > self.config.server.max_queued_requests:
            raise RequestError(
                f"too many requests in flight ({len(self.states)}; --max-queued-requests "
                f"{self.config.server.max_queued_requests}); retry later", kind="overloaded",
                retry_after=OVERLOADED_RETRY_AFTER_S)

    async def generate(self, req: GenerateRequest, ids: list[int] | None = None,
                       rid: str | None = None, probe: bool = False,
                       on_output: Callable[[TextOut], None] | None = None) -> AsyncIterator[TextOut]:
        """Outputs of one request, the last with finished=True. Raises RequestError. `probe`:
        a health check's request, kept out of the metrics. `on_output`: called with every
        output but the last as it arrives, instead of yielding it (only the last is yielded);
        an exception it raises ends the request, raised from here."""
        rid = rid or req.rid or self.new_rid()
        if rid in self.states:
            raise RequestError(f"request id {rid!r} is already in use", param="rid")
        self.admit_check()
        state = _ReqState(probe=probe, on_output=on_output)
        # NOTE: the id is taken before the first await, so that of two requests with one id
        # arriving together, the second is refused here rather than reaching the scheduler.
        self.states[rid] = state
        try:
            if ids is None:
                ids = await self.prompt_ids(req)
            state.submitted = True
            await self.replicas.submit(GenerateReq(rid, ids, req.params.to_dict()))
            while True:
                msg = await state.queue.get()
                if isinstance(msg, _Failed):
                    raise msg.error
                if isinstance(msg, ReqError):
                    state.finished = True
                    if self.metrics and not probe:
                        self.metrics.request_errors.inc()
                    raise RequestError(msg.message, kind=msg.kind if msg.kind in RequestError.STATUS else "internal")
                if not probe:
                    self._observe(state, msg)
                yield msg
                if msg.finished:
                    state.finished = True
                    return
        finally:
            del self.states[rid]
            rank = self.replicas.release(rid)
            if state.submitted and not state.finished and rank is not None:
                self.spawn(self.replicas.send(rank, AbortReq(rid)))
                if self.metrics and not probe:
                    self.metrics.aborted.inc()

    async def abort_all(self) -> int:
        """Abort every request in flight (shutdown): each ends with finish_reason "abort"."""
        states = [(rid, s) for rid, s in self.states.items() if s.submitted and not s.finished and not s.abort_sent]
        for rid, state in states:
            state.abort_sent = True
            await self.replicas.abort(rid)
        return len(states)

    def _observe(self, state: _ReqState, out: TextOut) -> None:
        now = time.perf_counter()
        m = None if state.probe else self.metrics
        if m is not None and out.new_ids:
            if state.last_output is None:
                m.ttft.observe(now - state.created)
            else:
                gap = (now - state.last_output) / len(out.new_ids)
                for _ in out.new_ids:
                    m.itl.observe(gap)
            m.generation_tokens.inc(len(out.new_ids))
        if out.new_ids:
            state.last_output = now
        if m is not None and out.finished:
            m.e2e.observe(now - state.created)
            m.requests.inc()
            if out.finish_reason == "abort":
                m.aborted.inc()
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
            if out.spec_verify_ct:
                m.spec_accept_length_per_req.observe(out.spec_accept_length)

    async def abort(self, rid: str) -> bool:
        """Abort a request by id; False if no such request is in flight."""
        state = self.states.get(rid)
        if state is None:
            return False
        await self.replicas.abort(rid)
        return True

    async def check_grammar(self, params: SamplingParams) -> None:
        """Raise RequestError (400) naming what is wrong with the request's grammar. The grammar
        engine lives in the scheduler process (this one has no torch); asking it costs one
        round trip, only for constrained requests."""
        # One replica answers for all: a grammar's validity does not depend on where it runs.
        reply = await self._ask(lambda rid: CheckGrammarReq(rid, params.to_dict()), "check_grammar",
                                GRAMMAR_CHECK_TIMEOUT_S, ranks=[0])
        if not reply.ok:
            param = next((n for n in ("json_schema", "regex", "ebnf") if getattr(params, n) is not None), None)
            raise RequestError(str(reply.result.get("error", "invalid grammar")), param=param)

    async def admin(self, command: str, timeout: float = 10.0) -> AdminReply:
        """Ask every scheduler replica; with several, one merged reply (see merge_replies)."""
        return await self._ask(lambda rid: AdminReq(rid, command), command, timeout)

    async def _ask(self, make: Any, command: str, timeout: float, ranks: list[int] | None = None) -> AdminReply:
        """Send each replica in `ranks` (default: all) `make(rid)` and wait for their AdminReplies."""
        base = f"admin-{self.new_rid()}"
        ranks = list(range(self.replicas.size)) if ranks is None else ranks
        rids = [f"{base}-{rank}" for rank in ranks]
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[AdminReply]] = [loop.create_future() for _ in rids]
        self._admin_waiters.update(zip(rids, futs))
        try:
            for rank, rid in zip(ranks, rids):
                await self.replicas.send(rank, make(rid))
            replies = await asyncio.wait_for(asyncio.gather(*futs), timeout)
        except asyncio.TimeoutError:
            late = [str(rank) for rank, f in zip(ranks, futs) if not f.done()]
            who = "the scheduler" if self.replicas.size == 1 else f"scheduler replica(s) {', '.join(late)}"
            raise RequestError(f"{who} did not answer {command!r} within {timeout:.0f}s",
                               kind="unavailable") from None
        finally:
            for rid in rids:
                self._admin_waiters.pop(rid, None)
        if command == "flush_cache" and all(r.ok for r in replies):
            self.replicas.forget_prefixes()
        return replies[0] if len(replies) == 1 else merge_replies(base, list(replies))

    def spawn(self, coro: Any) -> None:
        """Run `coro` in the background, keeping a reference so it is not garbage-collected."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def finish_or_cancel(tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    """Give `tasks` up to `timeout` seconds to end, then cancel those still running and wait
    for them to unwind."""
    if tasks and timeout > 0:
        await asyncio.wait(tasks, timeout=timeout)
    left = [t for t in tasks if not t.done()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def merge_replies(rid: str, replies: list[AdminReply]) -> AdminReply:
    """One answer for several replicas: ok when every one is; numbers summed (requests, tokens,
    steps: totals over the server); the first error or health error named with its replica;
    each replica's own answer under "dp_ranks"."""
    merged: dict[str, Any] = {}
    for rank, reply in enumerate(replies):
        for key, value in reply.result.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            elif value is not None and merged.get(key) is None:
                merged[key] = f"dp rank {rank}: {value}" if key in ("error", "health_error") else value
            else:
                merged.setdefault(key, value)
    merged["dp_ranks"] = [r.result for r in replies]
    return AdminReply(rid, all(r.ok for r in replies), merged)
