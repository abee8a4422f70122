"""Structured output over HTTP (one server for the module): response_format and SGLang's
json_schema / regex on the default random model, whose every sample must still parse and
validate; invalid grammars are 400s that name the problem, streams included."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from minisgl_mp.client import Client, ServerError
from server_utils import ServerProcess, launch_server

TIMEOUT = 180
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
# Required fields, a nested object, an array, an enum and bounded integers; strings are
# bounded too, so that a random model closes the JSON within max_tokens. (By a pattern: with
# maxLength, xgrammar 0.2.9's string rule lets raw control characters through, which is not JSON.)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id", "vip"]},
    },
    "required": ["name", "age", "kind", "tags", "owner"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
MAX_TOKENS = 96  # the longest sample of SCHEMA seen is ~75 tokens


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--num-pages", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    return server.model


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as c:
        yield c


def test_every_json_sample_validates_greedy_and_20_seeds(client: openai.OpenAI, model: str) -> None:
    def chat_greedy() -> list[Any]:
        r = client.chat.completions.create(model=model, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                           temperature=0, max_tokens=MAX_TOKENS)
        return list(r.choices)

    def completions(seed: int) -> list[Any]:  # n samples with seeds seed, seed + 1, ...
        r = client.completions.create(model=model, prompt="A pet:", n=10, seed=seed, temperature=1.0,
                                      max_tokens=MAX_TOKENS, extra_body={"json_schema": json.dumps(SCHEMA)})
        return list(r.choices)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(chat_greedy), pool.submit(completions, 0), pool.submit(completions, 10)]
        choices = [c for f in futures for c in f.result()]
    assert len(choices) == 21
    texts = set()
    for c in choices:
        text = c.message.content if hasattr(c, "message") else c.text
        assert c.finish_reason == "stop", f"did not close within {MAX_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 5, "the seeds should give different samples"


def test_regex_outputs_match_in_full(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": ["Call me at"] * 8, "sampling_params": [
        {"regex": PHONE, "max_new_tokens": 32, "temperature": 1.0, "sampling_seed": s} for s in range(8)]})
    assert r.status_code == 200, r.text
    for out in r.json():
        assert re.fullmatch(PHONE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_stream_gives_the_same_text(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, messages=MESSAGES, response_format=RESPONSE_FORMAT, temperature=0,
                                  max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


class Owner(pydantic.BaseModel):
    id: int = pydantic.Field(ge=0, le=999)
    vip: bool


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=99)
    owner: Owner


def test_openai_parse_returns_the_pydantic_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet, temperature=0,
                                      max_tokens=MAX_TOKENS)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner)


@pytest.mark.parametrize("body, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"regex": "(ab"}, "regex"),
    ({"ebnf": 'root ::= item\nitem ::= "a" undefined_rule'}, "undefined_rule"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_grammar_is_a_400_naming_it(http: httpx.Client, body: dict[str, Any], named: str,
                                            stream: bool) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "regex": "[ab]+"})
    assert ok.status_code == 200 and re.fullmatch("[ab]+", ok.json()["choices"][0]["text"])


def test_zmq_endpoint_takes_the_same_constraints(server: ServerProcess) -> None:
    with Client(server.zmq, timeout=TIMEOUT) as c:
        out = c.generate("Call me at", sampling_params={"regex": PHONE, "max_tokens": 32})
        assert re.fullmatch(PHONE, out["text"]) and out["finish_reason"] == "stop"
        with pytest.raises(ServerError, match="regex is invalid"):
            c.generate("Call me at", sampling_params={"regex": "[0-9", "max_tokens": 4})
