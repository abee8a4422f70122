"""The tokenizer process: an asyncio loop (uvloop) serving the ZMQ client endpoint and the
HTTP API, tokenizing requests for the scheduler and routing outputs back to clients."""

from __future__ import annotations

import asyncio
import logging
import time
from multiprocessing.connection import Connection
from typing import Any

from minisgl_mp.server_config import ServerConfig
from minisgl_mp.utils.process import StatusPipe, StopFlag, child_main

logger = logging.getLogger("minisgl_mp.tokenizer")
# After the abort at the end of a drain: how long the "abort" replies get to reach their clients.
ABORT_GRACE_S = 2.0
# The reply of a request still open when the tokenizer process stops.
STOPPED_MESSAGE = "the server stopped before this request finished (its log says why)"


async def _serve(config: ServerConfig, status: StatusPipe, stop: StopFlag) -> None:
    import zmq.asyncio

    from minisgl_mp.engine.tokenizer import load_tokenizer
    from minisgl_mp.message.messages import SCHEDULER_CHANNEL, TOKENIZER_CHANNEL
    from minisgl_mp.message.transport import AsyncPullQueue, AsyncPushQueue
    from minisgl_mp.server.metrics import Metrics
    from minisgl_mp.tokenizer.manager import TokenizerManager
    from minisgl_mp.tokenizer.requests import RequestError
    from minisgl_mp.tokenizer.zmq_frontend import ZmqFrontend

    tokenizer = load_tokenizer(config.model.tokenizer_dir)
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer found in {config.model.tokenizer_dir}")
    ctx = zmq.asyncio.Context()
    from_detok = AsyncPullQueue(ctx, config.tokenizer_addr, TOKENIZER_CHANNEL, bind=True)
    to_scheds = [AsyncPushQueue(ctx, addr, SCHEDULER_CHANNEL) for addr in config.scheduler_addrs]
    manager = TokenizerManager(config, tokenizer, to_scheds, from_detok, Metrics(config.model.name))
    zmq_frontend = ZmqFrontend(ctx, config.zmq_endpoint, manager, config.server.max_payload_bytes,
                               config.server.api_key)
    tasks = [asyncio.create_task(manager.run_dispatch(), name="dispatch"),
             asyncio.create_task(zmq_frontend.serve(), name="zmq-frontend")]
    http_server = None
    if config.server.enable_http:
        from minisgl_mp.server.http import create_http_server

        http_server = create_http_server(config, manager)
        tasks.append(asyncio.create_task(http_server.serve(), name="http"))
        while not http_server.started:
            if tasks[-1].done():
                tasks[-1].result()  # raises the bind error
                raise RuntimeError(f"HTTP server on {config.http_url} did not start")
            await asyncio.sleep(0.02)
    status.ready(zmq=zmq_frontend.endpoint, http=config.http_url if http_server else None)
    try:
        while not stop.is_set:
            done = [t for t in tasks if t.done()]
            if done:
                done[0].result()  # a frontend died: raise its error
                raise RuntimeError(f"task {done[0].get_name()} ended unexpectedly")
            await asyncio.sleep(0.1)
        if not stop.immediate:
            timeout = 0.0 if stop.mode == "abort" else config.server.shutdown_timeout
            await _drain(manager, timeout, tasks, stop)
    finally:
        # Refuse new requests; fail those still open (a process died, or the drain was cut
        # short: no more outputs will come), so every client gets a reply rather than waiting
        # for its own timeout; let the HTTP server send those and close its connections; only
        # then stop routing and close the sockets (the failed requests' aborts go out first).
        manager.stopping = True
        left = manager.fail_all(RequestError(STOPPED_MESSAGE, kind="unavailable"))
        if left:
            logger.warning("shutting down: %d request(s) still open failed with %r", left, STOPPED_MESSAGE)
        await zmq_frontend.settle(timeout=1.0)
        if http_server is not None:
            http_server.should_exit = True
            await asyncio.wait([tasks[-1]], timeout=2.0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await zmq_frontend.settle(timeout=0.0)
        await manager.close(grace=0.5)
        zmq_frontend.close()
        from_detok.close()
        for q in to_scheds:
            q.close()
        ctx.term()


async def _drain(manager: Any, timeout: float, tasks: list[asyncio.Task[None]], stop: StopFlag) -> None:
    """SIGTERM: take no new requests (503), let those in flight finish for up to `timeout`
    seconds, then abort the rest, which end with finish_reason "abort". Every client gets a
    finished reply; the launcher stops the scheduler and detokenizer only after this."""
    manager.stopping = True
    if manager.states:
        logger.info("shutting down: %d request(s) in flight get up to %gs to finish (--shutdown-timeout)",
                    len(manager.states), timeout)
    deadline = time.monotonic() + timeout
    def cut_short() -> bool:  # told to stop now, or a frontend died
        return stop.immediate or any(t.done() for t in tasks)

    while manager.states and time.monotonic() < deadline and not cut_short():
        await asyncio.sleep(0.05)
    if manager.states and not cut_short():
        logger.info("shutting down: aborting %d request(s) still running", len(manager.states))
        deadline = time.monotonic() + ABORT_GRACE_S
        while manager.states and time.monotonic() < deadline and not cut_short():
            await manager.abort_all()  # again for any that were still being tokenized
            await asyncio.sleep(0.05)
    # Let the last replies leave before the HTTP server closes their connections.
    await asyncio.sleep(0.1)


def _body(config: ServerConfig, status: StatusPipe, stop: StopFlag) -> None:
    from minisgl_mp.utils.no_torch import block_torch

    block_torch()
    try:
        import uvloop
    except ImportError:  # no uvloop on this platform: the standard loop works too
        asyncio.run(_serve(config, status, stop))
    else:
        uvloop.run(_serve(config, status, stop))


def run_tokenizer_process(config: ServerConfig, conn: Connection) -> None:
    child_main("tokenizer", config.server.log_level, conn, lambda s, f: _body(config, s, f))
