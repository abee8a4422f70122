"""Starting the real server (the launcher and its three processes) from tests.

`launch_server()` runs `python -m minisgl_mp.launch` in its own process group, waits for its
ready line and parses the endpoints; `stop()` (also on any failure) sends SIGTERM, waits, then
kills the whole group, so a failing test leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx
import psutil

from minisgl_mp.client import Client

READY = re.compile(r"minisgl_mp ready: model (\S+), zmq (\S+)(?:, http (\S+))? \(pid (\d+)\)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    zmq: str
    http: str | None
    model: str
    log: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child_pids(self) -> dict[str, int]:
        """Process name ('scheduler', 'tokenizer', 'detokenizer') -> pid, from the log."""
        return {name: int(pid) for name, pid in re.findall(r"(\w+) process ready \(pid (\d+)\)", "\n".join(self.read_log()))}

    def read_log(self, timeout: float = 0.0) -> list[str]:
        _drain(self.proc, self.log, timeout)
        return self.log

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        procs = [psutil.Process(self.proc.pid)] + self.children() if self.proc.poll() is None else self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        _drain(self.proc, self.log, 0.5)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _drain(proc: subprocess.Popen[str], log: list[str], timeout: float) -> None:
    """Wait up to `timeout` s for more output (less once it has ended).

    A reader thread (`_start_reader`) collects the lines as they come: the server must never
    block on a full output pipe because a test is busy elsewhere, and a buffered readline()
    after select() could leave a line (the ready line) unseen until more output came."""
    reader = _READERS.get(proc.pid)
    if reader is not None:
        reader.join(timeout)
        if not reader.is_alive():
            _READERS.pop(proc.pid, None)


_READERS: dict[int, threading.Thread] = {}  # launcher pid -> the thread reading its output


def _start_reader(proc: subprocess.Popen[str], log: list[str]) -> None:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, name=f"server-log-{proc.pid}", daemon=True)
    reader.start()
    _READERS[proc.pid] = reader


def launch_server(model: str | Path, *args: str, timeout: float = 180.0, http: bool = True,
                  env: dict[str, str] | None = None) -> ServerProcess:
    cmd = [sys.executable, "-m", "minisgl_mp.launch", "--model", str(model), "--port", "0",
           "--zmq-port", "0", *(() if http else ("--no-enable-http",)), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    log: list[str] = []
    _start_reader(proc, log)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            _drain(proc, log, 0.2)
            for line in log:
                m = READY.search(line)
                if m:
                    return ServerProcess(proc, m.group(2), m.group(3), m.group(1), log)
            if proc.poll() is not None:
                _drain(proc, log, 0.5)
                raise RuntimeError(f"server exited with {proc.returncode} before ready:\n" + "\n".join(log[-40:]))
        raise RuntimeError(f"server not ready in {timeout}s:\n" + "\n".join(log[-40:]))
    except BaseException:
        ServerProcess(proc, "", None, "", log).stop(signal.SIGKILL)
        raise


def start_failure(model: str | Path, *args: str, timeout: float = 120.0) -> tuple[int, list[str]]:
    """Run a launch that should fail; returns (exit code, output lines)."""
    cmd = [sys.executable, "-m", "minisgl_mp.launch", "--model", str(model), "--port", "0", "--zmq-port", "0", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    return out.returncode, (out.stdout + out.stderr).splitlines()


def wait_idle_and_whole(c: Client, timeout: float = 60.0) -> dict[str, Any]:
    """Once the scheduler is idle: every page is free or evictable, nothing is locked, and the
    full integrity check (radix tree recount) passes."""
    deadline = time.monotonic() + timeout
    while True:
        stats = c.admin("stats")["result"]
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {stats}"
        time.sleep(0.2)
    health = c.admin("check_health")
    assert health["ok"], health
    assert stats["protected_tokens"] == 0, stats
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["total_tokens"], stats
    return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_router(worker_urls: list[str], policy: str, log_path: Path, *args: str,
                  timeout: float = 60.0) -> Iterator[str]:
    """sglang-router (`python -m sglang_router.launch_router`) in front of `worker_urls`, in
    its own process group; yields its URL once it answers /v1/models, stops it on exit."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *worker_urls, "--policy", policy, *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("sglang-router exited:\n" + log_path.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router not ready in {timeout:.0f}s:\n" + log_path.read_text()[-3000:])
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
