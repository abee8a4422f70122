"""The scheduler process: receive -> schedule -> forward -> process results -> send.

Under tensor parallelism there is one per rank: rank 0 talks to the tokenizer and the
detokenizer and shares what it receives (`rank_sync.py`); the others have no sockets, receive
from rank 0, and run the same steps on their slice of the model.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

import zmq

from minisgl_mp.detokenizer.incremental import PROMPT_TAIL_TOKENS
from minisgl_mp.message.messages import (
    DETOKENIZER_CHANNEL, SCHEDULER_CHANNEL, AbortReq, AdminReply, AdminReq, BatchTokenOut,
    CheckGrammarReq, DetokParams, GenerateReq, LogprobEntry, ReqError, ShutdownReq, TokenOut,
)
from minisgl_mp.message.transport import PullQueue, PushQueue
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.faults import FaultPlan
from minisgl_mp.scheduler.rank_sync import RankSync
from minisgl_mp.scheduler.req import TokenLogprobs
from minisgl_mp.scheduler.scheduler import ReqOutput, Scheduler
from minisgl_mp.scheduler.watchdog import Watchdog
from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.server_config import ServerConfig
from minisgl_mp.utils.process import StatusPipe, StopFlag, child_main

logger = logging.getLogger("minisgl_mp.scheduler")

IDLE_POLL_MS = 100  # how often an idle loop looks at the stop flag
# When idle, the page accounting is checked this often, and the prefix cache's full
# integrity (a walk of the whole tree) every FULL_CHECK_EVERY-th time.
HEALTH_CHECK_INTERVAL_S = 5.0
FULL_CHECK_EVERY = 12


class SchedulerLoop:
    """`inbox`/`outbox`: None on a tensor-parallel rank other than 0, which receives through
    `sync` and sends nothing."""

    def __init__(self, scheduler: Scheduler, inbox: PullQueue | None, outbox: PushQueue | None,
                 watchdog: Watchdog | None = None, sync: RankSync | None = None) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.outbox = outbox
        self.watchdog = watchdog
        self.sync = sync
        self._ranks_told = False  # whether the other ranks already have a ShutdownReq
        self._detok: dict[str, DetokParams] = {}  # sent with each request's first output
        self._last_health_check = 0.0
        self._health_checks = 0
        self.health_error: str | None = None

    def run_once(self) -> bool:
        """One turn of the loop; returns False when told to shut down."""
        for msg in self._receive():
            if isinstance(msg, ShutdownReq):  # under TP every rank has received it
                logger.info("shutdown requested: %s", msg.reason)
                self._ranks_told = True
                return False
            self._handle(msg)
        if self.watchdog is not None:
            self.watchdog.step_started()
        outputs = self.scheduler.step()
        if self.watchdog is not None:
            self.watchdog.step_ended()
        self._send(outputs)
        if not outputs and not self.scheduler.has_work:
            self._maybe_check_health()
        return True

    def _send(self, outputs: list[ReqOutput]) -> None:
        if self.outbox is None:
            return
        tokens = [self._token_out(o) for o in outputs if o.error is None]
        if tokens:
            self.outbox.put(BatchTokenOut(tokens))
        for o in outputs:
            if o.error is not None:  # after its tokens so far, in the order they happened
                self._detok.pop(o.rid, None)
                self.outbox.put(ReqError(o.rid, o.error, o.error_kind))

    def _reply(self, msg: object) -> None:
        if self.outbox is not None:
            self.outbox.put(msg)

    def _receive(self) -> list[object]:
        if self.inbox is None:  # a tensor-parallel rank other than 0
            return self.sync.share(None)
        # Idle: block (briefly, to notice a stop signal). Busy: take what has arrived, never wait.
        first = None if self.scheduler.has_work else self.inbox.get(timeout_ms=IDLE_POLL_MS)
        msgs = [] if first is None else [first]
        while (msg := self.inbox.get_nowait()) is not None:
            msgs.append(msg)
        return msgs if self.sync is None else self.sync.share(msgs)

    def tell_ranks_to_stop(self, reason: str) -> None:
        """Rank 0, on its way out: the other ranks leave their loops too (best effort: one
        that is already gone cannot be told)."""
        if self.sync is not None and self.sync.is_leader and not self._ranks_told:
            self._ranks_told = True
            try:
                self.sync.share([ShutdownReq(reason)])
            except Exception as e:  # noqa: BLE001 - stopping anyway; say why the others may not know
                logger.warning("could not tell the other ranks to stop: %s", e)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, GenerateReq):
            try:
                params = SamplingParams.from_dict(msg.sampling_params)
                self.scheduler.add_request(msg.rid, msg.input_ids, params)
            except (ValueError, TypeError) as e:
                self._reply(ReqError(msg.rid, str(e), "invalid_request"))
                return
            self._detok[msg.rid] = DetokParams(params.skip_special_tokens, list(params.stop),
                                               params.min_tokens, msg.input_ids[-PROMPT_TAIL_TOKENS:],
                                               params.include_stop_str_in_output)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, AdminReq):  # every rank runs it (flush_cache changes the cache)
            self._reply(self._admin(msg))
        elif isinstance(msg, CheckGrammarReq):  # every rank checks it (and so compiles it)
            try:
                self.scheduler.check_grammar(SamplingParams.from_dict(msg.sampling_params))
            except (ValueError, TypeError) as e:
                self._reply(AdminReply(msg.rid, False, {"error": str(e)}))
                return
            self._reply(AdminReply(msg.rid, True, {}))

    def _admin(self, msg: AdminReq) -> AdminReply:
        if msg.command == "ping":  # liveness: answered between two steps
            return AdminReply(msg.rid, True, {"running": len(self.scheduler.running),
                                              "waiting": len(self.scheduler.waiting)})
        if msg.command == "stats":
            return AdminReply(msg.rid, True, {**self.scheduler.engine_stats(), "health_error": self.health_error})
        if msg.command == "flush_cache":
            try:
                return AdminReply(msg.rid, True, {"freed_tokens": self.scheduler.flush_cache()})
            except RuntimeError as e:
                return AdminReply(msg.rid, False, {"error": str(e)})
        if msg.command == "check_health":
            if self.scheduler.has_work:
                return AdminReply(msg.rid, False, {"error": "busy: the KV accounting is checked when idle"})
            self._maybe_check_health(force=True)
            return AdminReply(msg.rid, self.health_error is None, {"health_error": self.health_error})
        return AdminReply(msg.rid, False, {"error": f"unknown admin command {msg.command!r}"})

    def _maybe_check_health(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_health_check < HEALTH_CHECK_INTERVAL_S:
            return
        self._last_health_check = now
        self._health_checks += 1
        try:
            self.scheduler.check_health(full=force or self._health_checks % FULL_CHECK_EVERY == 1)
            self.health_error = None
        except Exception as e:  # noqa: BLE001 - report any inconsistency, keep serving
            self.health_error = str(e)
            logger.error("idle health check failed: %s", e)

    def _token_out(self, o: ReqOutput) -> TokenOut:
        return TokenOut(
            rid=o.rid, new_ids=o.new_token_ids, finished=o.finished, finish_reason=o.finish_reason,
            matched_stop=o.matched_stop, prompt_tokens=o.prompt_tokens,
            completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens,
            logprobs=[_entry(lp) for lp in o.logprobs],
            detok=self._detok.pop(o.rid, None),
            prompt_logprobs=[_entry(lp) for lp in o.prompt_logprobs] if o.prompt_logprobs else None,
            spec_verify_ct=o.spec_verify_ct, spec_accepted_tokens=o.spec_accepted_tokens,
        )


def _entry(lp: TokenLogprobs) -> LogprobEntry:
    return LogprobEntry(lp.token_logprob, list(lp.top_ids), list(lp.top_logprobs))


def _join_group(config: ServerConfig, rank: int) -> tuple[ServerConfig, TPGroup]:
    """This rank's config (its own CUDA device) and its place in the tensor-parallel group."""
    from minisgl_mp.utils.device import resolve_device

    engine = config.engine
    device = resolve_device(engine.device)
    if device.type == "cuda" and device.index is None:
        local_rank = rank - config.local_ranks.start
        engine = replace(engine, device=f"cuda:{local_rank}")
        device = resolve_device(engine.device)
    # A rank waits in a collective while rank 0 runs a step alone (none does), so the timeout
    # only bounds joining and a peer that hangs: the watchdog's bound, or start-up's.
    timeout = max(config.server.startup_timeout, config.server.watchdog_timeout, 60.0)
    group = TPGroup.join(rank, engine.tp_size, config.dist_init_addr, device, timeout)
    return replace(config, engine=engine), group


def _body(config: ServerConfig, status: StatusPipe, stop: StopFlag, rank: int) -> None:
    from tqdm import tqdm

    from minisgl_mp.engine.builder import build_scheduler

    # tqdm guards its bars (even disabled ones) with a multiprocessing semaphore, which a
    # process that crashes (os._exit) leaves to the launcher's resource tracker, which then
    # warns of a leak. This process draws bars from its own threads only.
    tqdm.set_lock(threading.RLock())
    group = None
    if config.engine.tp_size > 1:
        config, group = _join_group(config, rank)
    scheduler, _ = build_scheduler(config.engine, progress=False, faults=FaultPlan.from_env(), tp=group)
    sync = RankSync(group) if group is not None else None
    ctx = zmq.Context()
    inbox = outbox = None
    if rank == 0:
        inbox = PullQueue(ctx, config.scheduler_addr, SCHEDULER_CHANNEL, bind=True)
        outbox = PushQueue(ctx, config.detokenizer_addr, DETOKENIZER_CHANNEL)
    watchdog = Watchdog(config.server.watchdog_timeout, lambda reason: status.send("error", message=reason))
    loop = SchedulerLoop(scheduler, inbox, outbox, watchdog, sync)
    stats = scheduler.engine_stats()
    status.ready(kv_tokens=stats["total_tokens"], rank=rank)
    try:
        while not stop.is_set and loop.run_once():
            pass
        loop.tell_ranks_to_stop("the server is stopping")
    finally:
        for q in (inbox, outbox):
            if q is not None:
                q.close()
        ctx.term()
        if group is not None:
            group.close()


def scheduler_process_name(config: ServerConfig, rank: int) -> str:
    return config.scheduler_name if rank == 0 else f"scheduler-rank{rank}"


def run_scheduler_process(config: ServerConfig, conn: Connection, rank: int = 0) -> None:
    child_main(scheduler_process_name(config, rank), config.server.log_level, conn, lambda s, f: _body(config, s, f, rank),
               drain_on_sigterm=False)
    if config.engine.tp_size > 1:
        # Everything is closed and the launcher told; the interpreter's own teardown after
        # torch.distributed was seen to hang in native code (no Python frame left), so leave
        # now, once multiprocessing's finalizers have released what they track (semaphores).
        from multiprocessing import util

        util._exit_function()
        logging.shutdown()
        os._exit(0)
