"""Every error row of the HTTP API against one real server started with an API key and small
limits: OpenAI's error shape {"error": {"message", "type", "param", "code"}} with the right
status, clear messages, and nothing left running after a rejected request."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_utils import ServerProcess, launch_server

TIMEOUT = 120
KEY = "sk-test-key"
MAX_PAYLOAD = 16384
MAX_QUEUED = 3
MAX_N = 4
POOL = 2048  # KV tokens: a prompt this long passes the context check but not the scheduler's
CONTEXT = 4096
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--num-pages", str(POOL), "--api-key", KEY,
                       "--max-payload-bytes", str(MAX_PAYLOAD), "--max-queued-requests", str(MAX_QUEUED),
                       "--max-n", str(MAX_N)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http, timeout=TIMEOUT, headers=AUTH) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The error object of a response that must have `status` and OpenAI's error shape."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


def stats(http: httpx.Client) -> dict[str, Any]:
    return http.get("/engine_stats").json()


def wait_idle(http: httpx.Client, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (s := stats(http))["running"] or s["waiting"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    return s


# ---- 400: invalid fields, named with their allowed range ------------------------------------------
COMPLETION_ROWS = [
    ({"temperature": -1}, "temperature", "temperature must be a number >= 0"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"top_k": 0}, "top_k", "-1 (all tokens) or an integer >= 1"),
    ({"max_tokens": "ten"}, "max_tokens", "max_tokens must be an integer >= 1, got 'ten'"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens 0 is only allowed with echo: true"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be an integer >= 1"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens", "[0, max_tokens=5]"),
    ({"stop": 5}, "stop", "stop must be a string or a list of non-empty strings"),
    ({"seed": -1}, "seed", "[0, 2^63)"),
    ({"n": 0}, "n", f"n must be an integer in [1, {MAX_N}]"),
    ({"n": MAX_N + 1}, "n", f"[1, {MAX_N}]"),
    ({"n": 1.5}, "n", "n must be an integer"),
    ({"logprobs": 6}, "logprobs", "logprobs must be null or an integer in [0, 5]"),
    ({"echo": "yes"}, "echo", "echo must be true or false"),
    ({"stream": 1}, "stream", "stream must be true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ({"ignore_eos": "no"}, "ignore_eos", "ignore_eos must be true or false"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "logit_bias must be an object mapping token ids >= 0 to numbers in [-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias: token id 99999 is outside the vocabulary"),
    ({"lora_path": "x"}, "lora_path", "lora_path='x' is not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "tool calling is only supported on /v1/chat/completions"),
    ({"prompt": {"text": "x"}}, "prompt", "prompt must be a string, a list of strings"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": [[1, 2], [9999999]]}, "prompt", "outside the vocabulary [0, 8192)"),
]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("fields,param,message", COMPLETION_ROWS,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(COMPLETION_ROWS)])
def test_completion_field_errors(http: httpx.Client, fields: dict[str, Any], param: str, message: str) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **fields}), 400)
    assert message in err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_ROWS = [
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages", "must be an object with a string 'role'"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be an integer >= 1"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be {\"type\": \"function\""),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "names the function 'other', which is not in tools"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "null only beside tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments must be valid JSON"),
]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("fields,param,message", CHAT_ROWS, ids=[f"{r[1]}-{i}" for i, r in enumerate(CHAT_ROWS)])
def test_chat_field_errors(http: httpx.Client, fields: dict[str, Any], param: str, message: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert message in err["message"] and err["param"] == param


@pytest.mark.timeout(TIMEOUT)
def test_openai_client_sees_bad_request(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert "temperature must be a number >= 0" in e.value.message


@pytest.mark.timeout(TIMEOUT)
def test_over_the_context_length(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": [1] * CONTEXT, "max_tokens": 1}), 400)
    assert f"{CONTEXT} tokens" in err["message"] and f"context length is {CONTEXT}" in err["message"]
    err = error_of(http.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": CONTEXT - 6}), 400)
    assert f"{CONTEXT + 4} tokens" in err["message"] and str(CONTEXT) in err["message"]
    assert err["param"] == "max_tokens"
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": CONTEXT}), 400)
    assert f"over the context length of {CONTEXT}" in err["message"]


@pytest.mark.timeout(TIMEOUT)
def test_a_bad_later_prompt_starts_nothing(http: httpx.Client) -> None:
    before = wait_idle(http)
    body = {"prompt": [[1, 2, 3], [4] * CONTEXT], "max_tokens": 2000, "ignore_eos": True}
    error_of(http.post("/v1/completions", json=body), 400)
    time.sleep(0.5)
    after = stats(http)
    for key in ("running", "waiting", "prefill_tokens", "finished", "aborted"):
        assert after[key] == before[key], key


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("content,message", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "body is empty"),
    (b'{"prompt": "hi", "temperature": NaN}', "not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
], ids=["syntax", "utf8", "array", "empty", "nan", "deep"])
def test_body_that_is_not_a_json_object(http: httpx.Client, content: bytes, message: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        err = error_of(http.post(path, content=content, headers={"Content-Type": "application/json"}), 400)
        assert message in err["message"], (path, err)


# ---- 413, 401, 404, 405 ----------------------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_payload_too_large(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * MAX_PAYLOAD}).encode()
    err = error_of(http.post("/v1/completions", content=big), 413)
    assert str(MAX_PAYLOAD) in err["message"]
    # Without a Content-Length (chunked upload) the bytes actually read are counted.
    chunks = iter([big[i:i + 4096] for i in range(0, len(big), 4096)])
    error_of(http.post("/generate", content=chunks), 413)


@pytest.mark.timeout(TIMEOUT)
def test_api_key_is_required(server: ServerProcess, http: httpx.Client) -> None:
    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as anonymous:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/generate"), ("GET", "/metrics"), ("GET", "/engine_stats"),
                             ("POST", "/flush_cache")]:
            err = error_of(anonymous.request(method, path, json={"prompt": "hi"}), 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        for header in ("Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"):
            error_of(anonymous.get("/v1/models", headers={"Authorization": header}), 401)
        assert anonymous.get("/health").status_code == 200  # probes need no key
    wrong = openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert http.get("/v1/models").status_code == 200


@pytest.mark.timeout(TIMEOUT)
def test_unknown_model_and_path(http: httpx.Client) -> None:
    for path, body in [("/v1/completions", {"prompt": "hi", "model": "gpt-4"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"})]:
        err = error_of(http.post(path, json=body), 404)
        assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    assert error_of(http.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"
    error_of(http.get("/v1/nothing-here"), 404)
    error_of(http.get("/v1/completions"), 405)


@pytest.mark.timeout(TIMEOUT)
def test_native_generate_errors(http: httpx.Client) -> None:
    assert "exactly one of" in error_of(http.post("/generate", json={"sampling_params": {}}), 400)["message"]
    err = error_of(http.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}}), 400)
    assert "temperature must be a number >= 0" in err["message"]
    err = error_of(http.post("/generate", json={"text": "hi", "sampling_params": {"max_tokens": 2, "max_new_tokens": 3}}), 400)
    assert "sets max_tokens twice" in err["message"]
    err = error_of(http.post("/generate", json={"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}), 400)
    assert "logprob_start_len (2) must be less than the number of prompt tokens (2)" in err["message"]


# ---- errors from the scheduler: a 400, or an SSE error event once a stream has begun --------------
@pytest.mark.timeout(TIMEOUT)
def test_scheduler_rejection_in_and_out_of_a_stream(http: httpx.Client) -> None:
    body = {"prompt": [1] * (POOL + 10), "max_tokens": 4}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert f"the KV pool holds only {POOL}" in err["message"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert f"the KV pool holds only {POOL}" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "invalid_request_error"


# ---- 503: too many requests in flight -------------------------------------------------------------
@pytest.mark.timeout(TIMEOUT)
def test_queue_limit_and_duplicate_rid(http: httpx.Client, server: ServerProcess) -> None:
    wait_idle(http)
    err = error_of(http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}), 503)
    assert f"--max-queued-requests {MAX_QUEUED}" in err["message"] and err["type"] == "server_overloaded"
    # Long enough to outlast the test, short enough that the scheduler admits all three at once.
    long = {"sampling_params": {"max_tokens": 600, "ignore_eos": True}, "stream": True}
    with ExitStack() as streams, httpx.Client(base_url=server.http, timeout=TIMEOUT, headers=AUTH,
                                              limits=httpx.Limits(max_connections=8)) as other:
        held = []
        for i in range(MAX_QUEUED):
            body = {"text": "hi", "rid": f"long-{i}", **long}
            r = streams.enter_context(other.stream("POST", "/generate", json=body))
            held.append(r.iter_lines())  # referenced: a dropped iterator closes its connection
            next(line for line in held[-1] if line)
        dup = error_of(http.post("/generate", json={"text": "hi", "rid": "long-0"}), 400)
        assert "request id 'long-0' is already in use" in dup["message"] and dup["param"] == "rid"
        for path, body in [("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            assert error_of(http.post(path, json=body), 503)["code"] == "overloaded"
    wait_idle(http, timeout=30)  # closing the streams aborted them
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
