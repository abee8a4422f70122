"""`python -m minisgl_mp.launch --model <folder | hub id | short name>`: start the server.

The launcher resolves the model, makes a private directory for the internal sockets, starts
the tokenizer, scheduler (one per --dp-size replica) and detokenizer processes, waits until each says it is ready, prints
one line with the endpoints, then supervises: if any process dies, it stops the others and
exits non-zero naming which died and why. SIGINT and SIGTERM stop everything within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from minisgl_mp.distributed.shard import TPShard
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.source import ModelNotFoundError, resolve_model
from minisgl_mp.server_config import ModelInfo, ServerArgs, ServerConfig
from minisgl_mp.utils.cli import add_dataclass_args, dataclass_from_args
from minisgl_mp.utils.process import ABORT_NOW_SIGNAL, STOP_NOW_SIGNAL, read_status, setup_logging

logger = logging.getLogger("minisgl_mp.launch")
STOP_GRACE_S = 5.0
# Beyond --shutdown-timeout: the tokenizer's abort round and closing its HTTP connections.
DRAIN_GRACE_S = 10.0


class StartupError(RuntimeError):
    pass


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerArgs]:
    parser = argparse.ArgumentParser(prog="python -m minisgl_mp.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(parser, EngineConfig, "engine")
    add_dataclass_args(parser, ServerArgs, "server")
    args = parser.parse_args(argv)
    try:
        return dataclass_from_args(EngineConfig, args), dataclass_from_args(ServerArgs, args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def resolve_model_info(engine: EngineConfig, server: ServerArgs) -> ModelInfo:
    source = resolve_model(engine.model, engine.load_format, engine.tokenizer)
    cfg = ModelConfig.from_file(source.config_path)
    context_len = cfg.context_len(engine.context_length)
    TPShard(0, engine.tp_size).check(cfg)  # before any process starts: a clear error
    if source.tokenizer_dir is None:
        raise StartupError(f"model {engine.model!r} has no tokenizer; pass --tokenizer <folder>")
    return ModelInfo(name=server.served_model_name or engine.model, config_path=str(source.config_path),
                     tokenizer_dir=str(source.tokenizer_dir), context_len=context_len, vocab_size=cfg.vocab_size)


def pick_port(host: str, port: int, what: str) -> int:
    """Check that `port` is free on `host` (0: choose a free one), for a clear error up front."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(f"{what} port {port} on {host} is not available: {e.strerror}") from None
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    process: Any  # multiprocessing.Process
    status: Connection
    ready: bool = False
    error: str | None = None


class Launcher:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self._stop_reason: str | None = None
        self._signals = 0  # a second SIGINT/SIGTERM during the drain stops at once
        self._wakeup_r, self._wakeup_w = os.pipe()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1
        self._stop_reason = signal.Signals(signum).name
        os.write(self._wakeup_w, b"x")

    def start(self) -> None:
        from minisgl_mp.detokenizer.process import run_detokenizer_process
        from minisgl_mp.tokenizer.process import run_tokenizer_process

        ctx = mp.get_context("spawn")
        targets = scheduler_ranks(self.config)
        if self.config.server.node_rank == 0:
            targets += [("detokenizer", run_detokenizer_process, self.config, ()),
                        ("tokenizer", run_tokenizer_process, self.config, ())]
        for name, target, config, extra in targets:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(config, writer, *extra), name=f"minisgl_mp-{name}",
                               daemon=False)
            proc.start()
            writer.close()
            self.children.append(Child(name, proc, reader))

    def _poll_status(self) -> None:
        for c in self.children:
            while (event := read_status(c.status)) is not None:
                if event.get("event") == "ready":
                    c.ready = True
                    logger.info("%s process ready (pid %s)", c.name, event.get("pid"))
                elif event.get("event") == "error":
                    c.error = event.get("message")

    def dead_child(self) -> Child | None:
        self._poll_status()
        return next((c for c in self.children if not c.process.is_alive()), None)

    def _wait(self, timeout: float) -> None:
        objs: list[Any] = [c.process.sentinel for c in self.children] + [c.status for c in self.children]
        ready = wait(objs + [self._wakeup_r], timeout)
        if self._wakeup_r in ready:
            os.read(self._wakeup_r, 64)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.server.startup_timeout
        while True:
            if self._stop_reason:
                raise StartupError(f"interrupted by {self._stop_reason} during start-up")
            dead = self.dead_child()
            if dead is not None:
                raise StartupError(f"{dead.name} process failed to start: {self.why(dead)}")
            if all(c.ready for c in self.children):
                return
            if time.monotonic() > deadline:
                slow = ", ".join(c.name for c in self.children if not c.ready)
                raise StartupError(f"not ready after {self.config.server.startup_timeout:.0f}s: {slow}")
            self._wait(0.5)

    def supervise(self) -> int:
        """Until a signal (exit 0) or a child's death (exit 1). On a node other than 0, a rank
        that exits cleanly was told to by rank 0: the server stopped (exit 0)."""
        while True:
            if self._stop_reason:
                logger.info("received %s, shutting down", self._stop_reason)
                return 0
            dead = self.dead_child()
            if dead is not None and self.config.server.node_rank > 0 and dead.process.exitcode == 0:
                logger.info("%s exited: rank 0 stopped the server", dead.name)
                return 0
            if dead is not None:
                logger.error("%s process died (%s); stopping the server", dead.name, self.why(dead))
                return 1
            self._wait(1.0)

    def why(self, c: Child) -> str:
        self._poll_status()
        code = c.process.exitcode
        if c.error:
            return c.error
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def drain(self) -> str | None:
        """Graceful stop, first half: the tokenizer process refuses new requests, lets running
        ones finish (--shutdown-timeout; none after SIGINT), aborts the rest and exits, while
        the scheduler and detokenizer keep serving it. Returns why the drain was cut short, if
        it was."""
        tokenizer = next((c for c in self.children if c.name == "tokenizer"), None)
        if tokenizer is None or not tokenizer.process.is_alive():  # none on nodes other than 0
            return None
        # Ctrl+C means "now": running requests end with "abort" at once, cleanly.
        quick = self._stop_reason == "SIGINT"
        with contextlib.suppress(ProcessLookupError):
            os.kill(tokenizer.process.pid, ABORT_NOW_SIGNAL if quick else signal.SIGTERM)
        signals = self._signals
        deadline = time.monotonic() + (0.0 if quick else self.config.server.shutdown_timeout) + DRAIN_GRACE_S
        while tokenizer.process.is_alive():
            if self._signals > signals:
                return f"a second {self._stop_reason}: stopping without waiting for requests"
            dead = self.dead_child()
            if dead is not None and dead is not tokenizer:
                return f"{dead.name} process died during shutdown ({self.why(dead)})"
            if time.monotonic() > deadline:
                return "the tokenizer process did not finish its drain in time"
            self._wait(0.2)
        return None

    def stop(self) -> None:
        # Tensor-parallel ranks other than 0 last: rank 0 tells them to stop as it leaves, so
        # none of them is gone while rank 0 still waits in a collective with it.
        followers = [c for c in self.children if c.name.startswith("scheduler-rank")]
        for wave in ([c for c in self.children if c not in followers], followers):
            alive = [c for c in wave if c.process.is_alive()]
            for c in alive:
                with contextlib.suppress(ProcessLookupError):  # each loop notices within ~0.1 s
                    os.kill(c.process.pid, STOP_NOW_SIGNAL)
            deadline = time.monotonic() + STOP_GRACE_S
            for c in alive:
                c.process.join(max(0.0, deadline - time.monotonic()))
        for c in self.children:
            if c.process.is_alive():
                logger.warning("%s process did not stop in %.0fs; killing it", c.name, STOP_GRACE_S)
                c.process.kill()
                c.process.join(2.0)
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def scheduler_ranks(config: ServerConfig) -> list[tuple[str, Callable[..., None], ServerConfig, tuple[int]]]:
    """(process name, target, config, (rank,)) of each scheduler process this node runs: one per
    data-parallel replica (each with its own copy of the config), or one per tensor-parallel
    rank here; rank 0 (on node 0) is the one named "scheduler"."""
    from minisgl_mp.scheduler.process import run_scheduler_process, scheduler_process_name

    if config.server.dp_size > 1:
        replicas = [replace(config, dp_rank=rank) for rank in range(config.server.dp_size)]
        return [(r.scheduler_name, run_scheduler_process, r, (0,)) for r in replicas]
    return [(scheduler_process_name(config, rank), run_scheduler_process, config, (rank,))
            for rank in config.local_ranks]


def dist_init_addr(engine: EngineConfig, server: ServerArgs) -> str | None:
    """Where the tensor-parallel ranks meet: --dist-init-addr, or a free port here when every
    rank runs on this machine."""
    if engine.tp_size == 1 or server.dist_init_addr:
        return server.dist_init_addr
    return f"127.0.0.1:{pick_port('127.0.0.1', 0, 'tensor-parallel')}"


# The scheduler shares the cores with the tokenizer and detokenizer processes and, often, with
# the clients: OpenMP threads that spin while they wait for work would take the core from
# whoever needs it (measured on 2 cores with one other busy process: a decode step 7x slower
# than with sleeping waits). The user's own setting wins.
SERVER_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def main(argv: list[str] | None = None) -> int:
    engine, server = parse_args(argv)
    setup_logging(server.log_level, "launch")
    for key, value in SERVER_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)  # inherited by the spawned processes
    ipc_dir = None
    launcher = None
    try:
        model = resolve_model_info(engine, server)
        server = replace(server, dist_init_addr=dist_init_addr(engine, server))
        if server.node_rank == 0:  # the others serve no endpoint
            http_port = pick_port(server.host, server.port, "HTTP") if server.enable_http else server.port
            server = replace(server, port=http_port, zmq_port=pick_port(server.host, server.zmq_port, "ZMQ"))
        if server.node_rank == 0 and server.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("serving on %s: reachable from other machines%s", server.host,
                           "" if server.api_key else " without --api-key")
        ipc_dir = tempfile.mkdtemp(prefix="minisgl_mp-")  # mode 0700, unique per server
        logger.info("internal sockets in %s", ipc_dir)
        config = ServerConfig(engine=engine, server=server, model=model, ipc_dir=ipc_dir)
        launcher = Launcher(config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, launcher._on_signal)
        launcher.start()
        launcher.wait_ready()
    except (StartupError, ModelNotFoundError, ValueError, OSError) as e:  # GGUFError is a ValueError
        logger.error("failed to start: %s", e)
        if launcher is not None:
            launcher.stop()
        elif ipc_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        return 1
    endpoints = f"zmq {config.zmq_endpoint}" + (f", http {config.http_url}" if server.enable_http else "")
    if server.node_rank == 0:
        print(f"minisgl_mp ready: model {model.name}, {endpoints} (pid {os.getpid()})", flush=True)
    else:
        ranks = config.local_ranks
        print(f"minisgl_mp node {server.node_rank} ready: tensor-parallel ranks {ranks.start}-{ranks.stop - 1} "
              f"of {engine.tp_size} (pid {os.getpid()})", flush=True)
    code = 1
    try:
        code = launcher.supervise()
        if code == 0 and server.node_rank == 0:  # other nodes have nothing to drain
            cut_short = launcher.drain()
            if cut_short is not None:
                logger.warning("shutdown: %s", cut_short)
            dead = launcher.dead_child()
            if dead is not None and dead.name != "tokenizer":  # it crashed; it was not stopped
                logger.error("%s process died during shutdown (%s)", dead.name, launcher.why(dead))
                code = 1
    finally:
        launcher.stop()
    logger.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
