"""Fuzzing the request validation (hypothesis): whatever a client sends, the answer is a
clean error or a normal response, never an exception inside the server.

The HTTP app runs in-process on a real TokenizerManager with a fake engine (test_http_unit);
the ZMQ endpoint's parser (`parse_generate`) and `SamplingParams.from_dict` are fed directly.
The internal msgpack channels are fuzzed in test_messages.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.tokenizer.requests import RequestError, parse_generate
from test_http_unit import FakeEngine, run_app

SAMPLING_KEYS = ["max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "skip_special_tokens", "logprobs", "bogus"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=12))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
sampling_dicts = st.dictionaries(st.sampled_from(SAMPLING_KEYS), values, max_size=6)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(sampling_dicts)
def test_sampling_params_accept_or_raise_value_error(d: dict[str, Any]) -> None:
    try:
        SamplingParams.from_dict(d)
    except ValueError as e:
        assert str(e)


@FUZZ
@given(st.dictionaries(st.sampled_from(["rid", "text", "input_ids", "messages", "sampling_params", "stream"]),
                       values, max_size=5), sampling_dicts)
def test_the_zmq_request_parser_accepts_or_names_the_problem(d: dict[str, Any], sp: dict[str, Any]) -> None:
    if "sampling_params" not in d:
        d["sampling_params"] = sp
    try:
        req = parse_generate(d)
    except RequestError as e:
        assert e.message and e.status == 400
    else:
        assert sum(x is not None for x in (req.text, req.input_ids, req.messages)) == 1


OPENAI_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
               "stop", "stream", "stream_options", "seed", "logprobs", "top_logprobs", "echo", "top_k",
               "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "user", "junk"]
BASES = {
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/generate": {"text": "Hello there", "sampling_params": {"max_tokens": 3}},
}
plausible = st.one_of(st.integers(-1, 6), st.floats(0, 1.5), st.booleans(), st.none(), st.text(max_size=4),
                      st.lists(st.integers(0, 9000), max_size=3))
# Mostly-valid bodies (a valid request with a few fields changed) reach deep into the handlers;
# arbitrary JSON exercises the front door.
bodies = st.one_of(
    st.dictionaries(st.sampled_from(OPENAI_KEYS), json_values, max_size=7),
    json_values,
    st.dictionaries(st.sampled_from(OPENAI_KEYS), plausible, max_size=3),
)


@pytest.mark.timeout(300)
def test_the_http_api_answers_any_body_with_a_response_or_a_clean_error(tokenizer_dir: Path) -> None:
    seen: dict[int, int] = {}

    async def scenario(client: httpx.AsyncClient, manager: Any, engine: FakeEngine) -> None:
        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(st.sampled_from(sorted(BASES)), bodies, st.sampled_from(["base", "json", "broken"]))
        def one(path: str, body: Any, mode: str) -> None:
            if mode == "base" and isinstance(body, dict):
                body = {**BASES[path], **body}
            content = json.dumps(body).encode()
            if mode == "broken":
                content = content[:-1] + b"\xff"
            results.append((path, content))

        results: list[tuple[str, bytes]] = []
        one()
        for path, content in results:
            r = await client.post(path, content=content, headers={"Content-Type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, f"{path} {content[:200]!r} -> {r.status_code} {r.text[:300]}"
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"], r.text
        assert not manager.states, "a request was left in flight"

    run_app(tokenizer_dir, scenario)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
