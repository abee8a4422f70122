"""What users' tools send, against a real server: the openai SDK with the options people use,
the exact requests lm-eval builds (from lm-eval's own code when it is installed, else as
written down from its source), SGLang's native /generate and helper endpoints, and the metrics
SGLang's dashboards read."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch

from hf_reference import hf_logits, load_hf_model, torch_threads
from server_utils import ServerProcess, launch_server

TIMEOUT = 120
TOL = 1e-4
CONTEXT = "The quick brown fox jumps over"
CONTINUATION = " the lazy dog"

try:  # lm-eval 0.4.13's request builders and response parsers
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.models.sglang_generate_API import SGLANGGENERATEAPI
except ImportError:  # pragma: no cover - lm-eval is in the test extra
    LocalCompletionsAPI = SGLANGGENERATEAPI = None


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--num-pages", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def scored(tiny_model_dir: Path, http: httpx.Client) -> tuple[list[int], int, list[float]]:
    """(context + continuation ids, context length, transformers' log-probability of every
    token after the first), in float32."""
    ctx = http.post("/tokenize", json={"prompt": CONTEXT}).json()["tokens"]
    ids = http.post("/tokenize", json={"prompt": CONTEXT + CONTINUATION}).json()["tokens"]
    assert ids[: len(ctx)] == ctx
    with torch_threads():
        logprobs = torch.log_softmax(hf_logits(load_hf_model(tiny_model_dir), ids).float(), dim=-1)
    return ids, len(ctx), [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    want = {"model_name": None, **labels}
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r"^([\w:]+)\{(.*)\} (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if all(k in got and (v is None or got[k] == v) for k, v in want.items()):
                return float(m.group(3))
    return 0.0


# ---- lm-eval ----------------------------------------------------------------------------------------
def lm_eval_payload(api: Any, model: str, ids: list[int], native: bool) -> dict[str, Any]:
    """lm-eval's loglikelihood request for `ids` (its _create_payload(generate=False))."""
    if api is not None:
        return api._create_payload(SimpleNamespace(model=model, _max_gen_toks=256), [ids], generate=False)
    if native:  # written down from lm-eval 0.4.13's sglang_generate_API.py
        return {"input_ids": [ids], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "logprob_start_len": 0, "top_logprobs_num": 1, "return_logprob": True}
    return {"model": model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,  # openai_completions.py
            "seed": 1234, "echo": True}


@pytest.mark.timeout(TIMEOUT)
def test_lm_eval_local_completions_loglikelihood(server: ServerProcess, http: httpx.Client,
                                                 scored: tuple[list[int], int, list[float]]) -> None:
    ids, ctxlen, want = scored
    payload = lm_eval_payload(LocalCompletionsAPI, server.model, ids, native=False)
    assert payload["echo"] is True and payload["logprobs"] == 1 and payload["prompt"] == [ids]
    r = http.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1 : len(ids)], want)) < TOL
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    if LocalCompletionsAPI is not None:  # lm-eval's own parser: the continuation's log-likelihood
        (total, _greedy), = LocalCompletionsAPI.parse_logprobs(r.json(), ctxlens=[ctxlen])
        assert abs(total - sum(want[ctxlen - 1 :])) < TOL * len(ids)

    # vLLM's way: max_tokens 0 with echo scores the prompt and generates nothing.
    r = http.post("/v1/completions", json={**payload, "max_tokens": 0})
    body = r.json()
    assert r.status_code == 200, r.text
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["text"] == CONTEXT + CONTINUATION


@pytest.mark.timeout(TIMEOUT)
def test_lm_eval_sglang_generate_loglikelihood(server: ServerProcess, http: httpx.Client,
                                               scored: tuple[list[int], int, list[float]]) -> None:
    ids, ctxlen, want = scored
    r = http.post("/generate", json=lm_eval_payload(SGLANGGENERATEAPI, server.model, ids, native=True))
    assert r.status_code == 200, r.text
    out, = r.json()  # input_ids was a batch of one
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert max(abs(e[0] - w) for e, w in zip(meta["input_token_logprobs"][1:], want)) < TOL
    assert len(meta["output_token_logprobs"]) == 1 and meta["completion_tokens"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    if SGLANGGENERATEAPI is not None:
        (total, _greedy), = SGLANGGENERATEAPI.parse_logprobs(r.json(), ctxlens=[ctxlen])
        assert abs(total - sum(want[ctxlen - 1 :])) < TOL * len(ids)


@pytest.mark.timeout(TIMEOUT)
def test_lm_eval_generate_until_requests(server: ServerProcess, http: httpx.Client) -> None:
    kwargs = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0}
    if LocalCompletionsAPI is not None:
        self = SimpleNamespace(model=server.model, _max_gen_toks=256)
        completions = LocalCompletionsAPI._create_payload(self, ["Q: hi\nA:"], generate=True, gen_kwargs=dict(kwargs),
                                                          eos="<|im_end|>")
        native = SGLANGGENERATEAPI._create_payload(self, ["Q: hi\nA:"], generate=True, gen_kwargs=dict(kwargs),
                                                   eos="<|im_end|>")
    else:
        completions = {"prompt": ["Q: hi\nA:"], "model": server.model, "max_tokens": 8, "temperature": 0,
                       "stop": ["\n\n", "<|im_end|>"], "seed": 1234}
        native = {"sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": ["\n\n", "<|im_end|>"]},
                  "text": ["Q: hi\nA:"]}
    a = http.post("/v1/completions", json=completions)
    b = http.post("/generate", json=native)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()[0]["text"]  # both greedy
    assert b.json()[0]["meta_info"]["completion_tokens"] <= 8


# ---- the openai SDK -----------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_openai_sdk_options(server: ServerProcess, client: openai.OpenAI) -> None:
    forced = client.completions.create(model=server.model, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100}, user="someone")
    tok = httpx.post(server.http + "/detokenize", json={"tokens": [42, 42, 42]}).json()["prompt"]
    assert forced.choices[0].text == tok  # +100 makes token 42 the only choice

    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4, temperature=0,
        reasoning_effort="low", parallel_tool_calls=False, user="someone",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True,
                    # what sglang-router adds to every request, at its defaults
                    "continue_final_message": False, "no_stop_trim": False, "return_hidden_states": False,
                    "separate_reasoning": True, "stream_reasoning": True, "rid": None, "lora_path": None,
                    "some_future_field": 1})
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"

    # A field known but not implemented is refused at a value that would change the answer.
    with pytest.raises(openai.BadRequestError, match="lora_path='adapter' is not supported"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body={"lora_path": "adapter"})
    # no_stop_trim (SGLang) and include_stop_str_in_output (vLLM) keep the matched stop string.
    free = client.completions.create(model=server.model, prompt="Hello", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:6]
    cut = free[: free.index(stop)]
    for extra, want in (({}, cut), ({"no_stop_trim": True}, cut + stop), ({"include_stop_str_in_output": True}, cut + stop)):
        got = client.completions.create(model=server.model, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True, **extra}).choices[0]
        assert (got.text, got.finish_reason) == (want, "stop"), (extra, free, stop)


@pytest.mark.timeout(TIMEOUT)
def test_openai_sdk_continuous_usage_stats(server: ServerProcess, client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=server.model, prompt="Hello", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in with_text] == [1, 2, 3, 4]
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


# ---- SGLang's native API and helpers ----------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_sglang_generate_shapes(http: httpx.Client) -> None:
    one = http.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 5, "min_new_tokens": 5, "temperature": 0, "no_stop_trim": False,
        "spaces_between_special_tokens": True, "skip_special_tokens": True}}).json()
    assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 5
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"} <= set(
        one["meta_info"])

    default = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"ignore_eos": True}}).json()
    assert default["meta_info"]["completion_tokens"] == 128  # SGLang's default max_new_tokens

    batch = http.post("/generate", json={"text": ["Hello", "World"], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 7, "n": 2}}).json()
    assert len(batch) == 4 and [len(b["output_ids"]) for b in batch] <= [3] * 4
    again = http.post("/generate", json={"text": ["Hello", "World"], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 7, "n": 2}}).json()
    assert [b["text"] for b in batch] == [b["text"] for b in again]  # seeded

    r = http.post("/generate", json={"text": ["Hello", "World"], "stream": True,
                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    assert {e["index"] for e in events} == {0, 1}
    last = {e["index"]: e for e in events}
    assert all(e["meta_info"]["finish_reason"] == {"type": "length", "length": 2} for e in last.values())


@pytest.mark.timeout(TIMEOUT)
def test_sglang_and_vllm_helper_endpoints(server: ServerProcess, http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == server.model and info["is_generation"] is True
    assert http.get("/model_info").json() == info
    server_info = http.get("/get_server_info").json()
    assert server_info["served_model_name"] == server.model
    assert server_info["chunked_prefill_size"] == 2048  # the CPU's default prefill chunk
    load, = http.get("/get_load").json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and "num_tokens" in load
    assert http.get("/version").json()["version"]

    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    r = http.post("/generate", json={"messages": [{"role": "user", "content": "Hi"}],
                                     "sampling_params": {"max_new_tokens": 1}}).json()
    assert r["meta_info"]["prompt_tokens"] == chat["count"]
    assert http.get("/tokenizer_info").json()["eos_token"]
    assert http.post("/abort_request", json={"rid": "nothing-running"}).status_code == 200


@pytest.mark.timeout(TIMEOUT)
def test_metrics_use_sglang_names_and_skip_probes(http: httpx.Client) -> None:
    http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    before = metric(http, "sglang:num_requests_total")
    ttft = metric(http, "sglang:time_to_first_token_seconds_count")
    refused = metric(http, "sglang:num_refused_requests_total", reason="invalid_request")
    for path in ("/health", "/get_load", "/get_server_info", "/metrics"):
        assert http.get(path).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
    assert metric(http, "sglang:num_requests_total") == before
    assert metric(http, "sglang:time_to_first_token_seconds_count") == ttft
    assert metric(http, "sglang:num_refused_requests_total", reason="invalid_request") == refused + 1
    for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput",
                 "sglang:max_total_num_tokens", "sglang:e2e_request_latency_seconds_count",
                 "sglang:inter_token_latency_seconds_count"):
        assert f"\n{name}{{" in http.get("/metrics").text, name
