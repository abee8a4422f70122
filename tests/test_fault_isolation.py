"""Fault isolation in the real server (issue 13): a step that fails costs the requests of its
batch, not the server; a failure that repeats, or a step that hangs, stops the server with the
reason named. Faults are injected with MINISGL_MP_FAULTS (scheduler/faults.py), which counts
model forwards from 1, so each test sends its requests one phase at a time."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl_mp.client import Client, ServerError
from server_utils import ServerProcess, launch_server, wait_idle_and_whole

pytestmark = pytest.mark.timeout(300)

A, B, C, D, E = ([7 + 13 * i + j for j in range(6 + i)] for i in range(5))  # five distinct prompts
GREEDY4 = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def reference_tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """A fault-free run of the same requests, offline."""
    from minisgl_mp import LLM, SamplingParams

    llm = LLM(str(model), num_pages=4096)
    return [o["token_ids"] for o in llm.generate(prompts, SamplingParams(**GREEDY4))]


def sse_events(r: httpx.Response) -> list[Any]:
    lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_a_failed_step_fails_its_batch_and_the_server_goes_on(tiny_model_dir: Path) -> None:
    ref = reference_tokens(tiny_model_dir, [A, C, D, E])
    # Forwards 5 and 6 are B's prefill (over HTTP, then over ZMQ); 12 is the first decode of
    # D's stream (see below).
    server = launch_server(tiny_model_dir, "--num-pages", "4096",
                           env={"MINISGL_MP_FAULTS": "forward@5,forward@6,forward@12"})
    try:
        http = httpx.Client(base_url=server.http, timeout=60)
        with Client(server.zmq, timeout=60) as c:
            # Forwards 1-4: A runs alone and completes.
            assert c.generate(input_ids=A, sampling_params=GREEDY4)["token_ids"] == ref[0]
            # Forward 5 raises: B, alone in its batch, gets a 500 naming the exception.
            r = http.post("/v1/completions", json={"prompt": B, **GREEDY4})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "internal_error" and "InjectedFault" in err["message"], err
            # Forward 6 raises: the same on the ZMQ endpoint.
            with pytest.raises(ServerError) as info:
                c.generate(input_ids=B, sampling_params=GREEDY4)
            assert info.value.error["type"] == "internal" and "InjectedFault" in info.value.error["message"]
            # Forwards 7-10: C completes, as in a run without faults.
            assert c.generate(input_ids=C, sampling_params=GREEDY4)["token_ids"] == ref[1]
            # Forward 11 is D's prefill (its first token streams out), 12 raises: the stream
            # ends with an error event, then [DONE].
            with http.stream("POST", "/v1/completions", json={"prompt": D, "stream": True, **GREEDY4}) as r:
                assert r.status_code == 200
                events = sse_events(r)
            assert events[0]["choices"][0]["text"] != "" and "error" not in events[0]
            assert events[-1]["error"]["type"] == "internal_error", events
            assert "InjectedFault" in events[-1]["error"]["message"]
            # E and A submitted together: both complete with the fault-free tokens.
            with ThreadPoolExecutor(2) as pool:
                outs = list(pool.map(lambda p: Client(server.zmq, timeout=60).generate(
                    input_ids=p, sampling_params=GREEDY4)["token_ids"], [E, A]))
            assert outs == [ref[3], ref[0]]
            # Nothing leaked, and the server is healthy by every probe.
            stats = wait_idle_and_whole(c)
            assert stats["failed_requests"] == 3 and stats["failed_steps"] == 3, stats
            assert http.get("/health").status_code == 200
            assert http.get("/health_generate").status_code == 200
        assert server.proc.poll() is None, "the server must survive failed steps"
    finally:
        server.stop()


def wait_exit(server: ServerProcess, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.poll() is not None, f"the launcher did not exit within {timeout}s"
    server.read_log(2.0)
    return server.proc.returncode


def test_a_failure_that_repeats_every_step_stops_the_server_naming_it(tiny_model_dir: Path) -> None:
    server = launch_server(tiny_model_dir, "--num-pages", "4096", env={"MINISGL_MP_FAULTS": "forward@1+"})
    try:
        with Client(server.zmq, timeout=30) as c:
            for _ in range(2):  # each failure alone costs only its request
                with pytest.raises(ServerError, match="InjectedFault"):
                    c.generate(input_ids=A, sampling_params=GREEDY4)
            # The third in a row is fatal. Its request gets no output, and is told so at once
            # rather than left to its client's timeout.
            started = time.monotonic()
            with pytest.raises(ServerError, match="the server stopped before this request finished") as info:
                c.generate(input_ids=A, sampling_params=GREEDY4)
            assert info.value.error["type"] == "unavailable" and time.monotonic() - started < 10
        assert wait_exit(server, 30) == 1
        log = "\n".join(server.log)
        assert "scheduler process died" in log and "the same failure in 3 steps in a row" in log, log[-3000:]
        # Nothing is left to complain about on the way out: no background send on a closed
        # socket, no semaphore left to the resource tracker by the process that crashed.
        assert "never retrieved" not in log and "leaked semaphore" not in log, log[-3000:]
    finally:
        server.stop()


def test_a_hung_step_trips_the_watchdog(tiny_model_dir: Path) -> None:
    server = launch_server(tiny_model_dir, "--num-pages", "4096", "--watchdog-timeout", "2",
                           env={"MINISGL_MP_FAULTS": "hang@1"})
    try:
        http = httpx.Client(base_url=server.http, timeout=30)
        assert http.get("/health").status_code == 200
        with Client(server.zmq, timeout=60) as c, ThreadPoolExecutor(1) as pool:
            c.sock.send(__import__("msgpack").packb({"rid": "stuck", "input_ids": A, "sampling_params": GREEDY4}))
            started = time.monotonic()

            def stream() -> list[Any]:  # waits behind the hung step
                with http.stream("POST", "/v1/completions", json={"prompt": B, "stream": True, **GREEDY4}) as r:
                    return sse_events(r)
            events = pool.submit(stream)
            assert wait_exit(server, 60) == 1
            # Both requests in flight were told the server stopped, on each endpoint.
            reply = __import__("msgpack").unpackb(c.sock.recv()) if c.sock.poll(5000) else None
            assert reply is not None and reply["rid"] == "stuck", reply
            assert "the server stopped before this request finished" in reply["error"]["message"], reply
            last = events.result(timeout=10)[-1]
            assert last["error"]["type"] == "service_unavailable", last
            assert "the server stopped before this request finished" in last["error"]["message"]
        assert time.monotonic() - started < 30
        log = "\n".join(server.log)
        assert "watchdog: a scheduler step has run for" in log and "--watchdog-timeout 2s" in log, log[-3000:]
        # faulthandler's dump of every thread, naming where the step is stuck
        assert "most recent call first" in log and "faults.py" in log, log[-3000:]
        assert "scheduler process died" in log
        assert "did not stop" not in log  # the others stopped at once, no drain after a crash
    finally:
        server.stop()


def test_edge_requests_over_http_and_zmq(tiny_model_dir: Path) -> None:
    """Requests that used to crash or confuse the server: a stop id outside the vocabulary (the
    curl of issue 13), two requests with one rid at once, and the text of a stop token."""
    from minisgl_mp.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    server = launch_server(tiny_model_dir, "--num-pages", "4096")
    try:
        http = httpx.Client(base_url=server.http, timeout=60)
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "min_tokens": 1, "ignore_eos": True,
                                               "stop_token_ids": [99999999]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop_token_ids" and "outside the vocabulary" in err["message"], err
        with Client(server.zmq, timeout=60) as c:
            with pytest.raises(ServerError, match="stop_token_ids: token id 99999999"):
                c.generate("hi", sampling_params={"max_tokens": 4, "stop_token_ids": [99999999]})

        # Two requests with one rid at once: one runs, the other is refused; nothing else changes.
        body = {"rid": "twin", "input_ids": A, "sampling_params": {"max_tokens": 200, "temperature": 0,
                                                                   "ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda _: http.post("/generate", json=body), range(2)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [200, 400], [r.text for r in replies]
        refused = next(r for r in replies if r.status_code == 400).json()["error"]
        assert "already in use" in refused["message"] and refused["param"] == "rid"

        # A stop token's text is not in the output; no_stop_trim / include_stop_str_in_output keep it.
        free = http.post("/generate", json={"input_ids": C, "sampling_params": {
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
        ids = free["output_ids"]
        k = ids.index(ids[4])
        params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [ids[4]]}
        cut = http.post("/generate", json={"input_ids": C, "sampling_params": params}).json()
        assert cut["output_ids"] == ids[: k + 1] and cut["text"] == tok.decode(ids[:k])
        kept = http.post("/generate", json={"input_ids": C, "sampling_params": {**params, "no_stop_trim": True}}).json()
        assert kept["text"] == tok.decode(ids[: k + 1])
        r = http.post("/v1/completions", json={"prompt": C, **params, "include_stop_str_in_output": True})
        assert r.json()["choices"][0]["text"] == tok.decode(ids[: k + 1])
        r = http.post("/v1/completions", json={"prompt": C, **params})
        assert r.json()["choices"][0]["text"] == tok.decode(ids[:k]), r.text
        with Client(server.zmq, timeout=60) as c:
            assert c.generate(input_ids=C, sampling_params=params)["text"] == tok.decode(ids[:k])
            wait_idle_and_whole(c)
    finally:
        server.stop()
