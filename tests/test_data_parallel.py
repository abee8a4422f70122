"""--dp-size 2: two scheduler replicas behind one tokenizer process answer as one replica does,
keep a shared prefix on one replica, go down together when one dies, and leave nothing behind
on SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from server_utils import ServerProcess, launch_server

TIMEOUT = 240
MAX_TOKENS = 5
# One torch thread per replica: two replicas share the machine's cores.
DP_ARGS = ("--dp-size", "2", "--num-threads", "1", "--num-pages", "1024")
PROMPTS = ["Hello", "The capital of France is", "1 2 3 4", "Once upon a time", "def f(x):", "a b a b a b"]
LONG_PREFIX = "You are a careful assistant. Answer briefly and cite the text you rely on. " * 4


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, *DP_ARGS) as s:
        yield s


def _complete(url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(TIMEOUT)
def test_greedy_outputs_equal_one_replica(server: ServerProcess, tiny_model_dir: Path) -> None:
    from minisgl_mp import LLM, SamplingParams

    with LLM(str(tiny_model_dir), num_pages=1024) as llm:
        want = [o["text"] for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                         ignore_eos=True))]
    got = [_complete(server.http, server.model, p)["choices"][0]["text"] for p in PROMPTS]
    assert got == want
    info = httpx.get(server.http + "/get_server_info", timeout=30).json()
    assert info["dp_size"] == 2 and len(info["internal_states"]) == 2


@pytest.mark.timeout(TIMEOUT)
def test_a_shared_prefix_is_served_from_the_replica_that_cached_it(server: ServerProcess) -> None:
    for topic in ("apples", "rivers", "engines", "violins"):
        first = _complete(server.http, server.model, f"About {topic}. {LONG_PREFIX} Q1")
        second = _complete(server.http, server.model, f"About {topic}. {LONG_PREFIX} Q2")
        prompt_tokens = second["usage"]["prompt_tokens"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_tokens - 4, (topic, first["usage"], second["usage"])
    stats = httpx.get(server.http + "/engine_stats", timeout=30).json()
    # New prefixes (distinct from their first tokens) spread over both replicas.
    assert all(r["cached_prompt_tokens"] > 0 for r in stats["dp_ranks"]), stats["dp_ranks"]
    assert stats["cached_prompt_tokens"] == sum(r["cached_prompt_tokens"] for r in stats["dp_ranks"])


@pytest.mark.timeout(TIMEOUT)
def test_health_metrics_and_flush_cover_every_replica(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.http, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert len(c.get("/get_load").json()) == 2
        flushed = c.post("/flush_cache").json()
        assert flushed["ok"] and len(flushed["dp_ranks"]) == 2
        stats = c.get("/engine_stats").json()
        assert stats["evictable_tokens"] == 0 and stats["total_tokens"] == 2 * 1024
        assert 'sglang:max_total_num_tokens{model_name="%s"} 2048.0' % server.model in c.get("/metrics").text


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_stops_every_replica_and_leaves_nothing(server: ServerProcess) -> None:
    children = server.children()
    assert sum("scheduler_dp" in line for line in server.read_log() if "process ready" in line) == 2
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive


@pytest.mark.timeout(TIMEOUT)
def test_a_dead_replica_takes_the_server_down_naming_it(tiny_model_dir: Path) -> None:
    with launch_server(tiny_model_dir, *DP_ARGS) as s:
        children = s.children()
        victim = s.child_pids()["scheduler_dp1"]
        psutil.Process(victim).kill()
        assert s.proc.wait(60) == 1
        deadline = time.monotonic() + 5
        while not any("scheduler_dp1 process died" in line for line in s.read_log(0.2)):
            assert time.monotonic() < deadline, "\n".join(s.log[-20:])
        assert any("scheduler_dp1 process died (killed by signal SIGKILL)" in line for line in s.log)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
