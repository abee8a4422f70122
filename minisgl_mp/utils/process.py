"""What every child process does the same way: die with its parent, stop when the launcher
says so (Ctrl+C and SIGTERM are the launcher's to handle), report ready or a startup error to
the launcher over a pipe (JSON, never pickle), and log with its name."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

PR_SET_PDEATHSIG = 1


# How the launcher stops its children. SIGTERM asks the tokenizer process to drain: no new
# requests, running ones finish within --shutdown-timeout, the rest end with "abort".
# ABORT_NOW_SIGNAL (Ctrl+C at the launcher) drains with no wait: every running request ends
# with "abort" at once. STOP_NOW_SIGNAL (another process died, or a second signal) stops at
# once; the scheduler and detokenizer treat all three alike.
ABORT_NOW_SIGNAL = signal.SIGUSR2
STOP_NOW_SIGNAL = signal.SIGUSR1


class StopFlag:
    """Set by any of the stop signals above; `mode` says which: "drain", "abort" or "now".
    Loops poll it between short blocking waits.

    `drain_on_sigterm` False (the scheduler and detokenizer): SIGTERM is left to the launcher.
    A SIGTERM sent to the whole process group (`kill %1` in a shell, `timeout`, a service
    manager's default) reaches every process at once; the tokenizer process drains, and it
    needs the scheduler and detokenizer to go on serving its running requests until it is
    done, after which the launcher stops them with STOP_NOW_SIGNAL. SIGINT is ignored for the
    same reason (Ctrl+C in a terminal signals the group)."""

    def __init__(self, drain_on_sigterm: bool = True) -> None:
        self._event = threading.Event()
        self.mode = "drain"
        signal.signal(signal.SIGTERM, (lambda *_: self._stop("drain")) if drain_on_sigterm else signal.SIG_IGN)
        signal.signal(ABORT_NOW_SIGNAL, lambda *_: self._stop("abort"))
        signal.signal(STOP_NOW_SIGNAL, lambda *_: self._stop("now"))
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _stop(self, mode: str) -> None:
        if not self._event.is_set() or mode == "now":  # "now" overrides a drain under way
            self.mode = mode
        self._event.set()

    @property
    def immediate(self) -> bool:
        return self.mode == "now"

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()


class StatusPipe:
    """The child's end of its status pipe to the launcher."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name

    def send(self, event: str, **info: Any) -> None:
        try:
            self.conn.send_bytes(json.dumps({"event": event, "process": self.name, **info}).encode())
        except (BrokenPipeError, OSError):
            pass  # the launcher is gone; the parent-death signal takes it from here

    def ready(self, **info: Any) -> None:
        self.send("ready", pid=os.getpid(), **info)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the launcher dies (even by SIGKILL); elsewhere a watchdog
    thread notices the parent change."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr, force=True,
    )


def child_main(name: str, log_level: str, conn: Connection,
               body: Callable[[StatusPipe, StopFlag], None], drain_on_sigterm: bool = True) -> None:
    """Run a process body; any exception becomes an 'error' event for the launcher and exit 1.
    `drain_on_sigterm`: see StopFlag."""
    die_with_parent()
    setup_logging(log_level, name)
    status = StatusPipe(conn, name)
    stop = StopFlag(drain_on_sigterm)
    try:
        body(status, stop)
    except BaseException as e:  # noqa: BLE001 - report whatever ended the process, then exit
        logging.getLogger(name).error("%s process failed: %s\n%s", name, e, traceback.format_exc())
        status.send("error", message=f"{type(e).__name__}: {e}")
        sys.stderr.flush()
        os._exit(1)
    status.send("exit")


def read_status(conn: Connection) -> dict[str, Any] | None:
    """The launcher's end: one event, or None if nothing (more) can come."""
    try:
        if not conn.poll():
            return None
        return json.loads(conn.recv_bytes(1 << 16))
    except (EOFError, OSError, ValueError):
        return None
