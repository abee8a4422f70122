"""SIGTERM with requests in flight (issue 13): the server stops taking requests (503 with
Retry-After), lets the running ones finish for up to --shutdown-timeout, ends the rest with
finish_reason "abort", and exits 0 within the bound: never a 500, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl_mp.client import Client
from server_utils import launch_server

pytestmark = pytest.mark.timeout(300)

SHUTDOWN_TIMEOUT_S = 4.0
LONG = 3000  # tokens: cannot finish within the shutdown timeout, so these get aborted
SHORT = 40  # tokens: finish during the drain, or before it


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        events = [json.loads(x) for x in lines if x != "[DONE]"]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        return {"status": r.status_code, "done": lines[-1:] == ["[DONE]"],
                "errors": [e for e in events if "error" in e], "finish": [x for x in reasons if x]}


def _plain(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    finish = [c["finish_reason"] for c in r.json().get("choices", [])]
    return {"status": r.status_code, "done": True, "errors": [] if r.status_code == 200 else [r.json()],
            "finish": finish}


def _zmq(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    with Client(endpoint, timeout=120) as c:
        out = c.generate(input_ids=body["prompt"], sampling_params={
            k: v for k, v in body.items() if k in ("max_tokens", "temperature", "ignore_eos")})
    return {"status": 200, "done": out["finished"], "errors": [], "finish": [out["finish_reason"]]}


@pytest.mark.parametrize("target", ["launcher", "process group"])
def test_sigterm_drains_requests_in_flight_then_exits_zero(tiny_model_dir: Path, target: str) -> None:
    """SIGTERM to the launcher, or to its whole process group as `kill %1`, `timeout` or a
    service manager sends it: the scheduler and detokenizer must go on serving the drain."""
    server = launch_server(tiny_model_dir, "--num-pages", "65536", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        url = server.http
        jobs = []
        for i in range(16):
            body = {"prompt": [11 + i, 12, 13 + i], "max_tokens": LONG if i % 2 else SHORT,
                    "temperature": 0, "ignore_eos": True}
            kind = (_stream, _plain, _zmq, _stream)[i % 4]
            jobs.append((kind, body))
        results: list[dict[str, Any] | None] = [None] * len(jobs)

        def run(i: int) -> None:
            kind, body = jobs[i]
            try:
                results[i] = kind(server.zmq if kind is _zmq else url, body)
            except Exception as e:  # noqa: BLE001 - recorded, asserted on below
                results[i] = {"exception": repr(e)}

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while True:  # every request has reached the scheduler
            stats = httpx.get(f"{url}/engine_stats", timeout=10).json()
            # (The short ones may have finished already: counted too, or on a loaded machine
            # SIGTERM could go out before the last request arrived, which then rightly gets 503.)
            if stats["running"] + stats["waiting"] + stats["finished"] >= len(jobs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if target == "launcher":
            server.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.5)
        # Draining: new requests are refused with 503 and Retry-After, as is /health.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert int(r.headers["retry-after"]) > 0
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        server.proc.wait(SHUTDOWN_TIMEOUT_S + 20)
        elapsed = time.monotonic() - sent
        for t in threads:
            t.join(30)
        assert server.proc.returncode == 0, "\n".join(server.read_log(1.0)[-40:])
        assert elapsed < SHUTDOWN_TIMEOUT_S + 10, elapsed
        for (kind, body), res in zip(jobs, results):
            assert res is not None and "exception" not in res, (kind.__name__, res)
            assert res["status"] == 200 and res["done"] and not res["errors"], (kind.__name__, res)
            assert res["finish"] and res["finish"][0] in ("length", "abort"), (kind.__name__, res)
            if body["max_tokens"] == LONG:
                assert res["finish"] == ["abort"], (kind.__name__, res)
        log = "\n".join(server.read_log(1.0))
        assert "Traceback" not in log and " 500 " not in log and "died" not in log, log[-4000:]
        assert "aborting" in log  # the long ones were still running at the deadline
    finally:
        server.stop()
