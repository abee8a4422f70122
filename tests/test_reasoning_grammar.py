"""Structured output on a thinking model: the grammar starts when the thinking ends.

Over the openai SDK against a server started with `--reasoning-parser qwen3`, whose chat
template thinks by default. The random model never closes its thinking by itself, so every
request caps it (`thinking_token_budget`, vLLM's name; SGLang's `thinking_budget` too): the
think-end token is forced after that many tokens, and the answer after it is the grammar's.
So `reasoning_content` holds exactly the capped thinking and `content` (or `tool_calls`) the
answer, which parses and validates; with thinking off the grammar starts at the first token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.constrained.matcher import GrammarMatcher
from minisgl_mp.constrained.reasoning import ReasoningMatcher
from server_utils import ServerProcess, launch_server

pytest.importorskip("xgrammar")

TIMEOUT = 120
BUDGET = 6
MESSAGES = [{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}]
# An enum keeps the random model's answer short: it ends well within max_tokens.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]}},
          "required": ["city"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}}
REGEX = r"(Paris|Rome|Tokyo)"
EBNF = 'root ::= city " is the capital"\ncity ::= "Paris" | "Rome" | "Tokyo"'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (the request's constraint, a check of the answer)
CONSTRAINTS: dict[str, tuple[dict[str, Any], Any]] = {
    "response_format": ({"response_format": RESPONSE_FORMAT},
                        lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    "regex": ({"extra_body": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    "ebnf": ({"extra_body": {"ebnf": EBNF}},
             lambda text: re.fullmatch(r"(Paris|Rome|Tokyo) is the capital", text) or pytest.fail(text)),
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def reasoning(message: Any) -> str | None:
    return getattr(message, "reasoning_content", None)  # an extra field of the SDK's message


def with_budget(kwargs: dict[str, Any], budget: int | None = BUDGET, **extra: Any) -> dict[str, Any]:
    """`kwargs` with the thinking budget (and `extra`) in extra_body."""
    body = {**kwargs.get("extra_body", {}), **extra}
    if budget is not None:
        body["thinking_token_budget"] = budget
    return {**kwargs, "extra_body": body}


def streamed(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A stream's deltas joined: reasoning, content, tool calls' names and arguments, finish."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "name": "", "arguments": "", "finish": None}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        out["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
        out["content"] += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            out["name"] += tc.function.name or ""
            out["arguments"] += tc.function.arguments or ""
        out["finish"] = c.finish_reason or out["finish"]
    return out


def thinking_tokens(choice: Any) -> int:
    """Tokens before the think-end token, from the choice's logprobs."""
    tokens = [t.token for t in choice.logprobs.content]
    assert "</think>" in tokens, tokens
    return tokens.index("</think>")


# ---- the answer is content, the thinking reasoning ---------------------------------------------

@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_answer_after_capped_thinking(client: openai.OpenAI, server: ServerProcess, kind: str) -> None:
    constraint, check = CONSTRAINTS[kind]
    args = with_budget({"model": server.model, "messages": MESSAGES, "max_tokens": 64, "temperature": 1.0,
                        "seed": 11, **constraint})
    r = client.chat.completions.create(**args, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    check(choice.message.content)
    assert reasoning(choice.message) and "</think>" not in reasoning(choice.message)
    assert thinking_tokens(choice) == BUDGET
    assert r.usage.completion_tokens == len(choice.logprobs.content)
    s = streamed(client, **args)
    assert (s["reasoning"], s["content"], s["finish"]) == (reasoning(choice.message), choice.message.content, "stop")


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_tool_call_after_thinking(client: openai.OpenAI, server: ServerProcess, tool_choice: Any) -> None:
    args = with_budget({"model": server.model, "messages": MESSAGES, "tools": [WEATHER, OTHER],
                        "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 96,
                        "temperature": 1.0, "seed": 5})
    r = client.chat.completions.create(**args)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = msg.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert reasoning(msg) and not msg.content
    s = streamed(client, **args)
    assert (s["name"], s["arguments"], s["reasoning"], s["finish"]) == (
        call.function.name, call.function.arguments, reasoning(msg), "tool_calls")


@pytest.mark.timeout(TIMEOUT)
def test_sglang_name_and_budget_zero(client: openai.OpenAI, server: ServerProcess) -> None:
    """SGLang's thinking_budget is the same setting; a budget of 0 closes the thinking at once."""
    base = {"model": server.model, "messages": MESSAGES, "max_tokens": 48, "temperature": 1.0, "seed": 2,
            "response_format": RESPONSE_FORMAT}
    ours = client.chat.completions.create(**with_budget(base, 3))
    sglang = client.chat.completions.create(**with_budget(base, None, thinking_budget=3))
    assert ours.choices[0].message.content == sglang.choices[0].message.content
    assert reasoning(ours.choices[0].message) == reasoning(sglang.choices[0].message)
    r = client.chat.completions.create(**with_budget(base, 0), logprobs=True)
    assert thinking_tokens(r.choices[0]) == 0 and reasoning(r.choices[0].message) is None
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


# ---- thinking off, max_tokens, no budget ------------------------------------------------------

@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_constrains_from_the_first_token(client: openai.OpenAI, server: ServerProcess,
                                                      stream: bool) -> None:
    """With enable_thinking false the template closes the thinking in the prompt: the first
    token is the grammar's, and a budget has nothing to cap."""
    args = with_budget({"model": server.model, "messages": MESSAGES, "max_tokens": 48, "temperature": 1.0,
                        "seed": 4, "response_format": RESPONSE_FORMAT},
                       chat_template_kwargs={"enable_thinking": False})
    if stream:
        s = streamed(client, **args)
        content, think = s["content"], s["reasoning"] or None
    else:
        r = client.chat.completions.create(**args, logprobs=True)
        content, think = r.choices[0].message.content, reasoning(r.choices[0].message)
        assert r.choices[0].logprobs.content[0].token == "{"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert think is None


@pytest.mark.timeout(TIMEOUT)
def test_max_tokens_counts_thinking_and_answer(client: openai.OpenAI, server: ServerProcess) -> None:
    base = {"model": server.model, "messages": MESSAGES, "temperature": 1.0, "seed": 11,
            "response_format": RESPONSE_FORMAT}
    whole = client.chat.completions.create(**with_budget(base), max_tokens=64)
    answer = whole.choices[0].message.content
    cut = client.chat.completions.create(**with_budget(base), max_tokens=BUDGET + 4)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == BUDGET + 4
    assert reasoning(cut.choices[0].message) == reasoning(whole.choices[0].message)
    # The same sample cut short: the answer's first tokens (the think-end token is the 7th).
    assert answer.startswith(cut.choices[0].message.content) and cut.choices[0].message.content
    # Without a budget the grammar waits for a think-end this model never writes: all thinking.
    free = client.chat.completions.create(**base, max_tokens=24)
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    assert reasoning(free.choices[0].message) and free.usage.completion_tokens == 24


# ---- other endpoints, errors -------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT)
def test_generate_and_completions_take_require_reasoning(server: ServerProcess, tiny_model_dir: Path) -> None:
    """A raw prompt may or may not open a thinking: the client says so (SGLang's require_reasoning)."""
    from transformers import AutoTokenizer

    think_end = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("</think>")
    prompt = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    sp = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 1, "regex": REGEX,
          "thinking_token_budget": BUDGET}
    native = httpx.post(server.http + "/generate", json={"text": prompt, "require_reasoning": True,
                                                           "sampling_params": sp}, timeout=TIMEOUT).json()
    thought, end, answer = native["text"].partition("</think>")
    assert end and re.fullmatch(REGEX, answer), native["text"]
    assert native["output_ids"].index(think_end) == BUDGET
    comp = httpx.post(server.http + "/v1/completions", timeout=TIMEOUT, json={
        "prompt": prompt, "max_tokens": 48, "temperature": 1.0, "seed": 1, "regex": REGEX,
        "require_reasoning": True, "thinking_token_budget": BUDGET}).json()
    assert comp["choices"][0]["text"] == native["text"]


@pytest.mark.timeout(TIMEOUT)
def test_bad_budgets_are_400s(client: openai.OpenAI, server: ServerProcess) -> None:
    base = {"model": server.model, "messages": MESSAGES, "max_tokens": 8}
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(**base, extra_body={"thinking_token_budget": -1})
    with pytest.raises(openai.BadRequestError, match="same setting"):
        client.chat.completions.create(**base, extra_body={"thinking_token_budget": 2, "thinking_budget": 3})
    # A raw prompt with a budget but no require_reasoning: there is no thinking to cap.
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                          "thinking_token_budget": 2}, timeout=TIMEOUT)
    assert r.status_code == 400 and "require_reasoning" in r.json()["error"]["message"]


@pytest.mark.timeout(TIMEOUT)
def test_without_a_reasoning_parser_nothing_waits(tiny_model_dir: Path) -> None:
    """The server cannot tell where thinking ends: the grammar starts at once (as before), and a
    budget is refused rather than ignored."""
    with launch_server(tiny_model_dir) as plain:
        c = openai.OpenAI(base_url=plain.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        base = {"model": plain.model, "messages": MESSAGES, "max_tokens": 48, "temperature": 1.0, "seed": 4,
                "response_format": RESPONSE_FORMAT}
        r = c.chat.completions.create(**base, logprobs=True)
        assert r.choices[0].logprobs.content[0].token == "{"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
            c.chat.completions.create(**with_budget(base))


# ---- the offline engine, and the matcher itself ---------------------------------------------------

def test_offline_llm_takes_the_same_params(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024)
    try:
        ids = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(ids, add_special_tokens=False)
        think_end = llm.tokenizer.convert_tokens_to_ids("</think>")
        constrained, budget_only = llm.generate([ids, ids], [
            SamplingParams(max_tokens=64, temperature=1.0, seed=3, json_schema=SCHEMA, require_reasoning=True,
                           thinking_token_budget=BUDGET),
            SamplingParams(max_tokens=16, temperature=1.0, seed=3, require_reasoning=True, thinking_token_budget=2)])
    finally:
        llm.shutdown()
    assert constrained["token_ids"][BUDGET] == think_end and constrained["finish_reason"] == "stop"
    jsonschema.validate(json.loads(constrained["text"].partition("</think>")[2]), SCHEMA)
    # A budget without a grammar caps the thinking; what follows is free.
    assert budget_only["token_ids"][2] == think_end and len(budget_only["token_ids"]) == 16


class _Digits(GrammarMatcher):
    """A grammar of one or more of the tokens 0-9, ended by the token 10."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept_token(self, token: int) -> bool:
        ok = token < 10 or (token == 10 and bool(self.seen))
        self.seen += [token] if ok else []
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        bitmask[row, 0] = (1 << 11) - 1 if self.seen else (1 << 10) - 1

    def is_terminated(self) -> bool:
        return bool(self.seen) and self.seen[-1] == 10


def _allowed(m: GrammarMatcher, vocab: int = 64) -> list[int]:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    return [t for t in range(vocab) if bitmask[0, t // 32].item() >> (t % 32) & 1]


def test_matcher_forces_a_multi_token_think_end_then_hands_over() -> None:
    m = ReasoningMatcher(_Digits(), think_end=(40, 41), budget=3, banned_while_thinking=frozenset({63}))
    assert 63 not in _allowed(m) and len(_allowed(m)) == 63  # thinking: anything but the stop token
    assert not m.accept_token(63)
    for t in (20, 40, 21):  # a partial think-end, broken off: still thinking
        assert m.accept_token(t) and m.thinking
    assert _allowed(m) == [40] and not m.accept_token(20)  # budget spent: the end is forced
    assert m.accept_token(40) and _allowed(m) == [41]
    assert m.accept_token(41) and not m.thinking and not m.is_terminated()
    assert _allowed(m) == list(range(10))  # the grammar's turn, from its start
    assert m.accept_token(7) and m.accept_token(10) and m.is_terminated()


def test_matcher_natural_end_and_no_grammar() -> None:
    m = ReasoningMatcher(_Digits(), think_end=(40,), budget=None)
    assert all(m.accept_token(t) for t in (1, 2, 3, 40)) and not m.thinking
    assert not m.accept_token(20)  # the grammar's rules now
    free = ReasoningMatcher(None, think_end=(40,), budget=1)
    assert free.accept_token(5) and _allowed(free) == [40] and free.accept_token(40)
    assert len(_allowed(free)) == 64 and free.accept_token(63) and not free.is_terminated()
