"""Data parallelism across servers: two replicas behind sglang-router's cache_aware policy.

200 requests sharing ten prefixes, streamed and not, all come back equal to one replica's own
greedy answers; the router keeps each prefix on one replica (each request after the first of
its prefix reports the prefix as cached, and the replicas' cached-token counters agree); a
replica stopped with SIGTERM mid-traffic ends every request cleanly while the router goes on
serving through the other."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_utils import ServerProcess, launch_router, launch_server

pytest.importorskip("sglang_router")
TIMEOUT = 300
MAX_TOKENS = 4
ARGS = ("--num-threads", "1", "--num-pages", "4096")
TOPICS = ["apples", "rivers", "engines", "violins", "glaciers", "lanterns", "comets", "harbors", "orchids", "quarries"]
PREFIXES = [f"Notes on {t}: " + f"the {t} are described below in plain words, one fact per line. " * 3 for t in TOPICS]
QUESTIONS = ["Q: size?", "Q: color?", "Q: age?", "Q: where?", "Q: why?"]
PROMPTS = [p + q for p in PREFIXES for q in QUESTIONS]  # 50 prompts, each sent 4 times


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with launch_server(tiny_model_dir, *ARGS) as a, launch_server(tiny_model_dir, *ARGS) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(replicas: tuple[ServerProcess, ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with launch_router([r.http for r in replicas], "cache_aware", log_path) as url:
        yield url


def _complete(url: str, model: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    """The text, finish reason and usage of one completion, or {"error": status} when the
    server answered with a clean error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        assert r.status_code in (429, 500, 502, 503, 504) and r.text, (r.status_code, r.text)
        return {"error": r.status_code}
    if not stream:
        out = r.json()
        return {"text": out["choices"][0]["text"], "finish": out["choices"][0]["finish_reason"], "usage": out["usage"]}
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    if any("error" in e for e in events):
        return {"error": "stream"}
    choices = [e["choices"][0] for e in events if e.get("choices")]
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return {"text": "".join(c["text"] for c in choices), "finish": choices[-1]["finish_reason"], "usage": usage}


def _cached_total(replica: ServerProcess) -> float:
    text = httpx.get(replica.http + "/metrics", timeout=30).text
    return float(re.search(r"^sglang:cached_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))


@pytest.mark.timeout(TIMEOUT)
def test_200_requests_with_shared_prefixes_are_correct_and_keep_to_one_replica(
        router: str, replicas: tuple[ServerProcess, ServerProcess]) -> None:
    model = replicas[0].model
    jobs = [(p, copy % 2 == 1) for copy in range(4) for p in PROMPTS]  # (prompt, stream) x 200
    first = set(range(0, len(PROMPTS), len(QUESTIONS)))  # the first request of each prefix
    rest = [job for k, job in enumerate(jobs) if k not in first]
    # The router places each prefix before the rest arrive: together, so that its load rule
    # (with no cached match, the least-loaded worker) spreads the ten over both replicas.
    with ThreadPoolExecutor(len(first)) as pool:
        warm = list(pool.map(lambda k: _complete(router, model, *jobs[k]), sorted(first)))
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda job: _complete(router, model, *job), rest))

    # Correct: the same text as one replica's own greedy answer, streamed or not.
    with ThreadPoolExecutor(4) as pool:
        direct = dict(zip(PROMPTS, pool.map(lambda p: _complete(replicas[0].http, model, p, False)["text"], PROMPTS)))
    for (prompt, stream), out in zip([jobs[k] for k in sorted(first)] + rest, warm + outs):
        assert "error" not in out, (prompt, stream, out)
        assert out["finish"] == "length" and out["text"] == direct[prompt], (prompt, stream, out)

    # Affinity: after its prefix was placed, each request found it cached where it landed.
    for (prompt, stream), out in zip(rest, outs):
        usage = out["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2, (prompt, stream, usage)
    # Both replicas took part, and their counters hold what the answers reported.
    reported = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in warm + outs)
    per_replica = [_cached_total(r) for r in replicas]
    assert min(per_replica) > 0 and sum(per_replica) >= reported, (per_replica, reported)


@pytest.mark.timeout(TIMEOUT)
def test_sigterm_on_one_replica_mid_traffic_ends_cleanly_and_the_other_serves_on(
        router: str, replicas: tuple[ServerProcess, ServerProcess]) -> None:
    model = replicas[0].model
    a, b = replicas
    jobs = [(PROMPTS[k % 50], k % 2 == 0) for k in range(40)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, router, model, p, s, 16) for p, s in jobs]
        futures[7].result()  # traffic is flowing on both replicas
        b.proc.send_signal(signal.SIGTERM)
        outs = [f.result() for f in futures]
    assert b.proc.wait(60) == 0
    for out in outs:  # each finished whole, or ended with a clean error or "abort"
        assert "error" in out or out["finish"] in ("length", "abort"), out
    assert sum("error" not in o and o["finish"] == "length" for o in outs) >= len(outs) // 2, outs
    after = [_complete(router, model, p, stream=False) for p in PROMPTS[:10]]
    assert all("error" not in o and o["finish"] == "length" for o in after), after
    assert a.proc.poll() is None
