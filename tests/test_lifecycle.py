"""The server's life as its processes see it: any process's death stops the whole server
within seconds (non-zero, naming who died); SIGTERM and SIGINT stop it cleanly even under load;
a killed launcher takes its children with it; failed starts say why in one line and leave
nothing running; servers side by side do not meet.

Servers start in batches, at once (startup is mostly imports: they overlap), and each test
takes one of its own from its batch. They share a private TMPDIR, so the ipc directories they
make are this module's to check, and to clean up when a SIGKILL leaves one behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from minisgl_mp.client import Client
from server_utils import ServerProcess, launch_server

pytestmark = pytest.mark.timeout(300)

# Weights don't matter here: random ones, no prepacking, one torch thread, and a pool just big
# enough for the load below (the scheduler admits a request only with room for all its tokens).
LOAD_REQUESTS, LOAD_TOKENS = 16, 1000
LIGHT = ("--load-format", "dummy", "--no-cpu-prepack", "--num-threads", "1",
         "--num-pages", str(LOAD_REQUESTS * (LOAD_TOKENS + 16)), "--shutdown-timeout", "2")
STOP_WITHIN_S = 10.0
CHILDREN = ("scheduler", "detokenizer", "tokenizer")


@pytest.fixture(scope="module")
def ipc_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ipc")


def start_servers(model_dir: Path, tmpdir: Path, names: tuple[str, ...]) -> dict[str, ServerProcess]:
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(launch_server, model_dir, *LIGHT, http=False, env={"TMPDIR": str(tmpdir)})
                   for n in names}
    started = {n: f.result() for n, f in futures.items() if f.exception() is None}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        for srv in started.values():
            srv.stop(signal.SIGKILL)
        raise failed[0]  # type: ignore[misc]
    return started


def running_servers(model_dir: Path, tmpdir: Path, names: tuple[str, ...]) -> Iterator[dict[str, ServerProcess]]:
    started = start_servers(model_dir, tmpdir, names)
    try:
        yield started
    finally:
        for srv in started.values():
            srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def child_victims(tiny_model_dir: Path, ipc_tmpdir: Path) -> Iterator[dict[str, ServerProcess]]:
    """A server per child process to kill."""
    yield from running_servers(tiny_model_dir, ipc_tmpdir, CHILDREN)


@pytest.fixture(scope="module")
def signal_targets(tiny_model_dir: Path, ipc_tmpdir: Path) -> Iterator[dict[str, ServerProcess]]:
    """A server per signal to send to the launcher."""
    yield from running_servers(tiny_model_dir, ipc_tmpdir, ("SIGTERM", "SIGINT", "SIGKILL"))


@pytest.fixture
def neighbours(tiny_model_dir: Path, ipc_tmpdir: Path) -> Iterator[dict[str, ServerProcess]]:
    yield from running_servers(tiny_model_dir, ipc_tmpdir, ("a", "b"))


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running; a zombie (dead, not yet reaped by init) counts as gone."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def ipc_dir(srv: ServerProcess) -> Path:
    """The private directory of the server's internal sockets, from the scheduler's sockets."""
    sched = psutil.Process(srv.child_pids()["scheduler"])
    paths = [c.laddr for c in sched.net_connections("unix") if isinstance(c.laddr, str) and c.laddr.endswith(".sock")]
    assert paths, "the scheduler has no ipc socket"
    return Path(paths[0]).parent


def serves(srv: ServerProcess) -> bool:
    with Client(srv.zmq, timeout=60) as c:
        return c.generate("Hello", sampling_params={"max_tokens": 3})["finished"]


def wait_exit(srv: ServerProcess, within: float = STOP_WITHIN_S) -> int:
    start = time.monotonic()
    try:
        code = srv.proc.wait(within)
    except subprocess.TimeoutExpired:
        log = "\n".join(srv.read_log()[-20:])
        raise AssertionError(f"the launcher still runs {within:.0f} s later:\n{log}") from None
    print(f"launcher exited with {code} after {time.monotonic() - start:.2f} s")
    return code


def assert_stopped_cleanly(srv: ServerProcess, children: list[psutil.Process], ipc: Path) -> None:
    assert not wait_gone(children, 5.0), "orphan processes"
    assert not ipc.exists(), f"{ipc} was left behind"
    log = srv.read_log(0.5)
    assert not any("did not stop" in line for line in log), "\n".join(log[-20:])


# ---- a process dies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", CHILDREN)
def test_sigkill_of_a_child_brings_the_server_down(child_victims: dict[str, ServerProcess], victim: str) -> None:
    srv = child_victims[victim]
    children, ipc = srv.children(), ipc_dir(srv)
    os.kill(srv.child_pids()[victim], signal.SIGKILL)
    assert wait_exit(srv) != 0
    log = srv.read_log(0.5)
    assert any(f"{victim} process died (killed by signal SIGKILL); stopping the server" in line for line in log), \
        "\n".join(log[-20:])
    assert_stopped_cleanly(srv, children, ipc)


# ---- side by side, and signals to the launcher ----------------------------------------------------------------
def test_two_servers_side_by_side_each_serve_with_their_own_ipc_dir(neighbours: dict[str, ServerProcess]) -> None:
    a, b = neighbours["a"], neighbours["b"]
    dir_a, dir_b = ipc_dir(a), ipc_dir(b)
    assert dir_a != dir_b and dir_a.parent == dir_b.parent  # same TMPDIR, distinct directories
    assert dir_a.name.startswith("minisgl_mp-") and dir_b.name.startswith("minisgl_mp-")
    assert serves(a) and serves(b)
    # Stopping one leaves the other serving, its sockets untouched.
    a.proc.send_signal(signal.SIGTERM)
    assert wait_exit(a) == 0
    assert not dir_a.exists()
    assert serves(b) and dir_b.is_dir()


def _start_streams(srv: ServerProcess, n: int) -> zmq.Socket:
    """`n` long streaming requests, each seen producing tokens: in flight."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.zmq)
    for i in range(n):
        sock.send(msgpack.packb({"rid": f"load-{i}", "text": f"Stream {i}", "stream": True,
                                 "sampling_params": {"max_tokens": LOAD_TOKENS, "ignore_eos": True}}))
    running: set[str] = set()
    while len(running) < n:
        assert sock.poll(60_000), "no reply from the server"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert "error" not in reply, reply
        running.add(reply["rid"])
    return sock


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_under_load_stops_everything_cleanly(signal_targets: dict[str, ServerProcess],
                                                      sig: signal.Signals) -> None:
    srv = signal_targets[sig.name]
    children, ipc = srv.children(), ipc_dir(srv)
    sock = _start_streams(srv, LOAD_REQUESTS)
    try:
        srv.proc.send_signal(sig)
        assert wait_exit(srv) == 0
    finally:
        sock.close(linger=0)
    assert any(f"received {sig.name}, shutting down" in line for line in srv.read_log(0.5))
    assert_stopped_cleanly(srv, children, ipc)


def test_sigkill_of_the_launcher_takes_the_children_with_it(signal_targets: dict[str, ServerProcess]) -> None:
    srv = signal_targets["SIGKILL"]
    children = srv.children()
    assert len(children) >= len(CHILDREN)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(5)
    assert not wait_gone(children, 5.0), "children outlived their launcher"
    # The ipc directory stays (no one is left to remove it): it is in this module's TMPDIR.


# ---- failed starts -----------------------------------------------------------------------------------------
def failed_start(*args: str, timeout: float = 120.0, tmpdir: Path | None = None) -> tuple[int, list[str]]:
    """Run a launch that should fail: (exit code, output lines); asserts nothing of it is left."""
    cmd = [sys.executable, "-m", "minisgl_mp.launch", "--port", "0", "--no-enable-http", *args]
    env = {**os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Its session id is its pid: any process still in that session is one it left behind
    # (after a moment: multiprocessing's resource tracker exits just after the launcher).
    session = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                session.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    left = wait_gone(session, 5.0)
    assert not left, f"left running: {[(p.pid, p.cmdline()) for p in left]}"
    return proc.returncode, out.splitlines()


def error_lines(lines: list[str]) -> list[str]:
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    return [line for line in lines if "ERROR" in line or "error:" in line]


def test_a_bad_model_path_fails_with_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    code, lines = failed_start("--model", str(missing), "--zmq-port", "0")
    assert code != 0
    (line,) = error_lines(lines)
    assert f"failed to start: model '{missing}' not found" in line


def test_a_port_in_use_fails_with_one_clear_line(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = failed_start("--model", str(tiny_model_dir), "--zmq-port", str(port))
    assert code != 0
    (line,) = error_lines(lines)
    assert f"ZMQ port {port} on 127.0.0.1 is not available" in line


@pytest.mark.parametrize(("flag", "problem"), [
    (("--page-size", "0"), "page_size must be >= 1, got 0"),
    (("--max-running-requests", "many"), "argument --max-running-requests: invalid int value: 'many'"),
    (("--log-level", "loud"), "log_level must be debug, info, warning or error, got 'loud'"),
])
def test_an_invalid_flag_value_fails_with_one_clear_line(tiny_model_dir: Path, flag: tuple[str, str],
                                                        problem: str) -> None:
    code, lines = failed_start("--model", str(tiny_model_dir), "--zmq-port", "0", *flag)
    assert code != 0
    (line,) = error_lines(lines)
    assert problem in line


def test_a_child_that_fails_to_start_stops_the_others(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    code, lines = failed_start("--model", str(broken), "--zmq-port", "0", "--num-threads", "1", tmpdir=tmp_path)
    assert code != 0
    launcher_errors = [line for line in lines if "[launch] ERROR" in line]
    assert len(launcher_errors) == 1 and "failed to start: scheduler process failed to start: WeightLoadError: " \
        f"{broken / 'model.safetensors'}: cannot read safetensors header" in launcher_errors[0], "\n".join(lines)
    assert not list(tmp_path.glob("minisgl_mp-*")), "the ipc directory was left behind"
