"""Where a launched server's CPU time goes during a timed run.

`ProcessMeter` reads each process's CPU seconds (user + system, all threads; psutil) before
and after the run: the scheduler, tokenizer, detokenizer and launcher, and the benchmark client
itself, which shares the machine. Where Linux exposes them (`/proc/<pid>/task/*/schedstat` and
`status`), it also reads how long the process's threads waited for a core while ready to run,
and how often they went to sleep and were preempted: on a machine whose cores the processes
share, that is what a step loses to the others and to threads that sleep between its pieces.
`PySpy` additionally samples each server process with py-spy (when installed) and summarises the
samples by the function on top of the stack.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

READY_PID = re.compile(r"(\w+) process ready \(pid (\d+)\)")


def server_processes(launcher_pid: int, log_path: Path) -> dict[str, int]:
    """{name: pid} of a launched server: the launcher, then each child its log names as ready."""
    pids = {"launcher": launcher_pid}
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return pids
    for name, pid in READY_PID.findall(text):
        pids[name] = int(pid)
    return pids


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (all its threads); None when it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return t.user + t.system


# the lines of /proc/<pid>/task/<tid>/status that count a thread's sleeps and preemptions
SWITCH_FIELDS = ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")


def thread_sched(pid: int, proc: Path = Path("/proc")) -> dict[int, tuple[int, int, int]]:
    """{thread id: (ns spent ready to run but waiting for a core, sleeps, preemptions)} of each
    thread of a process so far; {} where the kernel does not expose them or the process is gone."""
    out: dict[int, tuple[int, int, int]] = {}
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            run_delay = int((task / "schedstat").read_text().split()[1])
            status = (task / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile, or no schedstat in this kernel
        switches = dict.fromkeys(SWITCH_FIELDS, 0)
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in switches:
                switches[key] = int(value)
        out[int(task.name)] = (run_delay, *switches.values())
    return out


def sched_delta(before: dict[int, tuple[int, int, int]],
                after: dict[int, tuple[int, int, int]]) -> dict[str, float] | None:
    """Summed over the threads alive at the end (a thread started meanwhile counts whole): the
    seconds they waited for a core, and how many times they slept and were preempted."""
    if not after:
        return None
    total = [0, 0, 0]
    for tid, now in after.items():
        then = before.get(tid, (0, 0, 0))
        for i in range(3):
            total[i] += now[i] - then[i]
    return {"waiting_seconds": total[0] / 1e9, "sleeps": total[1], "preemptions": total[2],
            "threads": len(after)}


class ProcessMeter:
    """CPU seconds each process spent between `start()` and `stop()`, and what share of the
    wall time that is (1.0 = one core busy throughout); with it, where the kernel says so, the
    time its threads spent ready but waiting for a core, as a share of the wall time too, and
    how many times they slept and were preempted."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {**pids, "benchmark client": os.getpid()}
        self._before: dict[str, float | None] = {}
        self._sched_before: dict[str, dict[int, tuple[int, int, int]]] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._sched_before = {name: thread_sched(pid) for name, pid in self.pids.items()}
        self._t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        procs = {}
        for name, pid in self.pids.items():
            sched = sched_delta(self._sched_before.get(name, {}), thread_sched(pid))
            before, after = self._before.get(name), cpu_seconds(pid)
            if before is None or after is None:
                continue
            procs[name] = {"pid": pid, "cpu_seconds": after - before, "cores": (after - before) / wall}
            if sched is not None:
                procs[name]["sched"] = {**sched, "waiting_cores": sched["waiting_seconds"] / wall}
        return {"wall_seconds": wall, "cpu_cores": os.cpu_count(), "processes": procs}


def sched_line(procs: dict[str, Any]) -> str | None:
    """One line for a run's output: per process, the cores' worth of time its threads waited
    ready to run, and their sleeps and preemptions; None where the kernel gave no figures."""
    parts = [f"{name} {p['sched']['waiting_cores']:.2f} ({p['sched']['sleeps']:,} sleeps, "
             f"{p['sched']['preemptions']:,} preempted)" for name, p in procs.items() if "sched" in p]
    return "  waiting for a core: " + ", ".join(parts) if parts else None


class PySpy:
    """py-spy record on each process while the run lasts; raw (collapsed) stacks go to
    `out_dir/<name>.txt`. Needs py-spy on PATH (or beside this Python) and ptrace permission."""

    def __init__(self, pids: dict[str, int], out_dir: Path, rate: int = 100) -> None:
        self.pids = pids
        self.out_dir = out_dir
        self.rate = rate
        self.exe = shutil.which("py-spy") or _beside_python("py-spy")
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._t0 = 0.0

    @property
    def available(self) -> bool:
        return self.exe is not None

    def start(self) -> None:
        if self.exe is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
                   "--output", str(self.out_dir / f"{name}.txt"), "--nonblocking"]
            self._procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached before the run starts
        self._t0 = time.perf_counter()

    def stop(self, top: int = 8) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        report: dict[str, Any] = {}
        for name, proc in self._procs.items():
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            path = self.out_dir / f"{name}.txt"
            if not path.exists():
                report[name] = {"error": err.decode(errors="replace").strip()[-300:] or "no output"}
                continue
            report[name] = {"file": str(path), **summarize(path, self.rate * wall, top)}
        return report


def _beside_python(name: str) -> str | None:
    import sys

    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else None


def _frame_name(frame: str) -> str:
    """'step (minisgl_mp/scheduler/scheduler.py:120)' -> 'step (scheduler/scheduler.py)'."""
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame.strip())
    if not m:
        return frame.strip()
    func, path = m.groups()
    parts = Path(path).parts
    short = "/".join(parts[parts.index("minisgl_mp") + 1 :]) if "minisgl_mp" in parts else "/".join(parts[-2:])
    return f"{func} ({short})"


def summarize(path: Path, possible_samples: float, top: int = 8) -> dict[str, Any]:
    """Samples on the CPU (py-spy drops idle ones) as a share of the run, and the functions most
    often on top of the stack, each as a share of the run's wall time."""
    leaves: Counter[str] = Counter()
    total = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        n = int(count)
        total += n
        leaves[_frame_name(frames[-1]) if frames else "(unknown)"] += n
    scale = max(possible_samples, 1.0)
    return {"busy_share": total / scale,
            "top_self": [{"function": f, "share": n / scale} for f, n in leaves.most_common(top)]}
