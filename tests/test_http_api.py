"""The HTTP API against a real server (three processes, the tiny model), with the `openai`
package as a user would drive it, plus httpx for SSE framing, the native /generate and admin
endpoints. Error rows that need other server flags are in test_http_limits.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server_utils import ServerProcess, launch_server

TIMEOUT = 120  # generous: other CPU-heavy tests may share the two cores
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # openai kwargs: a fixed-length greedy run


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--num-pages", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def sse_events(lines: Iterator[str]) -> list[Any]:
    """The JSON payloads of an SSE stream, checking the framing: only `data:` lines, ending in [DONE]."""
    events: list[Any] = []
    done = False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    assert done, "the stream did not end with data: [DONE]"
    return events


def post_stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def first_event(lines: Iterator[str]) -> Any:
    line = next(line for line in lines if line)
    return json.loads(line[len("data: "):])


def engine_stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/engine_stats")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 60.0) -> dict[str, Any]:
    """Poll /engine_stats until nothing runs or waits; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(http)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still running after {timeout}s: {stats}"
        time.sleep(0.2)


# ---- /v1/completions ------------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_completion_usage_matches_the_tokenizer(client: openai.OpenAI, server: ServerProcess, tokenizer: Any) -> None:
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, **GREEDY)
    assert r.object == "text_completion" and r.model == server.model
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


@pytest.mark.timeout(TIMEOUT)
def test_greedy_stream_equals_non_stream(client: openai.OpenAI, server: ServerProcess) -> None:
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.timeout(TIMEOUT)
def test_n_and_several_prompts_fan_out_prompt_major(client: openai.OpenAI, server: ServerProcess,
                                                    tokenizer: Any) -> None:
    prompts = ["one two three", "four"]
    r = client.completions.create(model=server.model, prompt=prompts, n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=server.model, prompt=p, max_tokens=4, **GREEDY).choices[0].text
               for p in prompts]
    # Greedy: both samples of a prompt equal that prompt's own completion, in prompt-major order.
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)  # once per prompt
    assert r.usage.completion_tokens == 4 * 4


@pytest.mark.timeout(TIMEOUT)
def test_token_id_prompts(client: openai.OpenAI, server: ServerProcess, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model=server.model, prompt=[ids, ids], max_tokens=5, **GREEDY)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2
    assert by_ids.usage.prompt_tokens == 2 * len(ids)


@pytest.mark.timeout(TIMEOUT)
def test_stop_string_and_stop_token(http: httpx.Client, client: openai.OpenAI, server: ServerProcess,
                                    tokenizer: Any) -> None:
    native = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    ids, text = native["output_ids"], native["text"]
    k = next(i for i in range(2, len(ids)) if tokenizer.decode([ids[i]]).strip())
    stop = tokenizer.decode([ids[k]]).strip()
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, stop=[stop], **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == stop
    assert choice.text == text.split(stop)[0]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [ids[k]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == ids[k]
    assert r.usage.completion_tokens == ids.index(ids[k]) + 1


@pytest.mark.timeout(TIMEOUT)
def test_seed_makes_sampling_repeatable(client: openai.OpenAI, server: ServerProcess) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))
    # n > 1 with a seed: the samples differ, yet the request as a whole repeats.
    two = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                    n=2, extra_body={"ignore_eos": True})
    again = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                      n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in two.choices] == [c.text for c in again.choices]


@pytest.mark.timeout(TIMEOUT)
def test_completion_logprobs_and_echo(client: openai.OpenAI, server: ServerProcess, tokenizer: Any) -> None:
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]

    echoed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, logprobs=1, echo=True,
                                       **GREEDY)
    c = echoed.choices[0]
    n_prompt = len(tokenizer.encode(PROMPT))
    assert c.text == PROMPT + r.choices[0].text
    # The prompt's tokens come first, scored, but for the first (null, as OpenAI and vLLM).
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:n_prompt])
    assert all(len(top) == 1 for top in c.logprobs.top_logprobs[1:n_prompt])
    # Within float rounding: the echo run recomputes the prompt the first run may have found cached.
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert echoed.usage.completion_tokens == 4


@pytest.mark.timeout(TIMEOUT)
def test_stream_include_usage_and_one_finish_per_choice(http: httpx.Client, server: ServerProcess) -> None:
    body = {"model": server.model, "prompt": ["a b", "c d e"], "n": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1,
            "echo": True}
    events = post_stream(http, "/v1/completions", body)
    whole = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    *chunks, last = events
    assert last["choices"] == []
    # All but the cached tokens: the second run finds the first one's prompts in the cache.
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert last["usage"][key] == whole["usage"][key]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        parts = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"]  # echo included, once
        assert [t for p in parts for t in p["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert parts[-1]["finish_reason"] == "length" and "matched_stop" in parts[-1]


# ---- /v1/chat/completions ------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_chat_completion(client: openai.OpenAI, server: ServerProcess, tokenizer: Any) -> None:
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    new_name = client.chat.completions.create(model=server.model, messages=MESSAGES, max_completion_tokens=6,
                                              **GREEDY)
    assert new_name.choices[0].message.content == msg.content


@pytest.mark.timeout(TIMEOUT)
def test_chat_stream_equals_non_stream(client: openai.OpenAI, server: ServerProcess) -> None:
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, n=2, **GREEDY)
    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, n=2,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    for index in (0, 1):
        parts = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert parts[0].delta.role == "assistant"  # the first chunk of each choice carries the role
        assert "".join(p.delta.content or "" for p in parts) == whole.choices[index].message.content
        assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]


@pytest.mark.timeout(TIMEOUT)
def test_chat_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                           **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


# ---- models, native API, admin -------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_models(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list()] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


@pytest.mark.timeout(TIMEOUT)
def test_native_generate_both_ways(http: httpx.Client, tokenizer: Any) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
            "rid": "native-test-1"}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["id"] == "native-test-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT)) and meta["completion_tokens"] == 6
    assert len(out["output_ids"]) == 6 and out["text"] == tokenizer.decode(out["output_ids"])
    events = post_stream(http, "/generate", {**body, "stream": True, "rid": "native-test-2"})
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, as SGLang streams
    assert events[-1]["text"] == out["text"] and events[-1]["output_ids"] == out["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events][:-1] == [None] * (len(events) - 1)
    by_ids = http.post("/generate", json={"input_ids": tokenizer.encode(PROMPT),
                                          "sampling_params": body["sampling_params"]}).json()
    assert by_ids["output_ids"] == out["output_ids"]


@pytest.mark.timeout(TIMEOUT)
def test_health_and_metrics(http: httpx.Client, client: openai.OpenAI, server: ServerProcess) -> None:
    r = http.get("/health")
    assert r.status_code == 200, r.text
    client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, **GREEDY)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("sglang:num_requests_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_seconds_count",
                 "sglang:num_running_reqs", "sglang:max_total_num_tokens"):
        assert name in r.text, name
    total = next(line for line in r.text.splitlines() if line.startswith("sglang:max_total_num_tokens{"))
    assert float(total.split()[-1]) == 8192  # gauges refreshed from the scheduler's stats


@pytest.mark.timeout(TIMEOUT)
def test_flush_cache(http: httpx.Client, server: ServerProcess) -> None:
    wait_idle(http)
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    stats = engine_stats(http)
    assert stats["evictable_tokens"] == 0 and stats["free_tokens"] == stats["total_tokens"]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
        first_event(lines)
        busy = http.post("/flush_cache")
    assert busy.status_code == 400
    assert "running" in busy.json()["error"]["message"] or "run" in busy.json()["error"]["message"]
    wait_idle(http)


# ---- disconnects ------------------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_stream_disconnect_aborts_and_frees_pages(http: httpx.Client, server: ServerProcess) -> None:
    before = wait_idle(http)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 2}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first_event(lines)
        assert engine_stats(http)["running"] == 2
    # 3000 tokens would take minutes: being idle within seconds means the requests were aborted.
    stats = wait_idle(http, timeout=30)
    assert stats["aborted"] == before["aborted"] + 2
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["total_tokens"]
    assert stats["protected_tokens"] == 0


@pytest.mark.timeout(TIMEOUT)
def test_non_stream_disconnect_aborts(server: ServerProcess, http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=server.http, timeout=httpx.Timeout(TIMEOUT, read=2.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/chat/completions", json=body)
    stats = wait_idle(http, timeout=30)
    assert stats["aborted"] == before["aborted"] + 1
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["total_tokens"]
