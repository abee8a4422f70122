"""Starting our server for a benchmark run and stopping it after (as tests/server_utils.py).

The server runs in its own process group with its output in a log file (a pipe nobody reads
would fill and stall it); the ready line in that log gives the endpoints. `stop()` sends
SIGTERM to the group, waits, then kills whatever is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"minisgl_mp ready: model (\S+), zmq (\S+)(?:, http (\S+))? \(pid (\d+)\)")


@dataclass
class LaunchedServer:
    proc: subprocess.Popen[bytes]
    model: str
    zmq: str
    http: str | None
    log_path: Path

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # children left behind, if any
        if self.proc.poll() is None:
            self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def launch_server(model: str, args: list[str], log_path: Path, timeout: float = 600.0) -> LaunchedServer:
    """`python -m minisgl_mp.launch --model <model> <args>` on free ports (unless `args` name
    them); returns once it is ready, or raises RuntimeError with the end of its log."""
    cmd = [sys.executable, "-m", "minisgl_mp.launch", "--model", model]
    if "--port" not in args:
        cmd += ["--port", "0"]
    if "--zmq-port" not in args:
        cmd += ["--zmq-port", "0"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            m = READY.search(log_path.read_text(encoding="utf-8", errors="replace"))
            if m:
                return LaunchedServer(proc, m.group(1), m.group(2), m.group(3), log_path)
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n{_tail(log_path)}")
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout:.0f}s:\n{_tail(log_path)}")
    except BaseException:
        LaunchedServer(proc, model, "", None, log_path).stop(timeout=5)
        raise
