"""Tool calling and reasoning over the openai SDK, against the real server started with
`--tool-call-parser qwen --reasoning-parser qwen3`.

The default model has random weights: it will not choose to call a tool or close its
thinking by itself. So these tests check what holds whatever it writes (the conversation
runs, prompts render as transformers renders them, reasoning is split off and `<think>` never
reaches the content), and the parsers' handling of real tool-call and think markup is tested
on model-like token streams in test_chat_parsers.py. With a grammar backend, `tool_choice`
"required" or a named function makes even this model call a tool with valid arguments.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_utils import ServerProcess, launch_server

TIMEOUT = 120
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    # Enums keep a constrained random model's arguments short: a free string could run to max_tokens.
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(tiny_model_dir, "--tool-call-parser", "qwen", "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def reasoning(message: Any) -> str | None:
    return getattr(message, "reasoning_content", None)  # an extra field of the SDK's message


def rendered_len(tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    """Prompt tokens of `messages` as transformers renders them, tool-call arguments as objects."""
    def as_objects(m: dict[str, Any]) -> dict[str, Any]:
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in m.get("tool_calls") or ()]
        return {**m, "tool_calls": calls} if calls else m
    text = tok.apply_chat_template([as_objects(m) for m in messages], tokenize=False, add_generation_prompt=True,
                                   **kwargs)
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.timeout(TIMEOUT * 2)
def test_two_turn_tool_conversation(client: openai.OpenAI, server: ServerProcess, hf_tokenizer: Any) -> None:
    """Call, tool result, answer: the second turn sends the SDK's own assistant message back."""
    first = client.chat.completions.create(model=server.model, messages=QUESTION, tools=[WEATHER], max_tokens=8,
                                           temperature=0)
    assert first.usage.prompt_tokens == rendered_len(hf_tokenizer, QUESTION, tools=[WEATHER])
    msg = first.choices[0].message
    assert "<tool_call>" not in (msg.content or "") and "<think>" not in (msg.content or "")
    # Whatever the random model wrote, the client answers with a call of its own and its result.
    calls = msg.tool_calls or [openai.types.chat.ChatCompletionMessageToolCall(
        id="call_0", type="function", function={"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'})]
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
               *({"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'} for c in calls)]
    second = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER], max_tokens=8,
                                            temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert second.usage.prompt_tokens == rendered_len(hf_tokenizer, history, tools=[WEATHER], enable_thinking=False)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reasoning(second.choices[0].message) is None  # thinking off: the answer is content
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


@pytest.mark.timeout(TIMEOUT)
def test_tool_choice_none_hides_the_tools(client: openai.OpenAI, server: ServerProcess, hf_tokenizer: Any) -> None:
    r = client.chat.completions.create(model=server.model, messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                       max_tokens=1)
    assert r.usage.prompt_tokens == rendered_len(hf_tokenizer, QUESTION)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.timeout(TIMEOUT * 2)
def test_reasoning_is_split_off(client: openai.OpenAI, server: ServerProcess) -> None:
    """Thinking is on by default: the output is reasoning until `</think>` (which the random
    model never writes, so all of it here); the same greedy text, unparsed, is what
    separate_reasoning=false returns."""
    args = {"model": server.model, "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    raw = client.chat.completions.create(**args, extra_body={"separate_reasoning": False}).choices[0].message
    assert reasoning(raw) is None and raw.content
    split = client.chat.completions.create(**args).choices[0].message
    assert reasoning(split) == raw.content.removeprefix("<think>")
    assert not split.content and "<think>" not in (split.content or "")
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta.model_dump()
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning(split), "content": ""}


@pytest.mark.timeout(TIMEOUT)
def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI, server: ServerProcess,
                                                     hf_tokenizer: Any) -> None:
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=4, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == rendered_len(hf_tokenizer, QUESTION, enable_thinking=False)
    assert r.usage.prompt_tokens == rendered_len(hf_tokenizer, QUESTION) + 4  # <think> \n\n </think> \n\n
    assert reasoning(r.choices[0].message) is None and r.choices[0].message.content


@pytest.mark.timeout(TIMEOUT)
def test_a_think_token_ends_the_reasoning(client: openai.OpenAI, server: ServerProcess, hf_tokenizer: Any) -> None:
    """`</think>` is one token; a logit bias makes the random model write it first, so the
    reasoning is empty and the rest is content."""
    end = hf_tokenizer.convert_tokens_to_ids("</think>")
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2, temperature=0,
                                       logit_bias={str(end): 100})
    assert reasoning(r.choices[0].message) is None and r.choices[0].message.content == "</think>"


# ---- tool_choice required / named: constrained decoding ---------------------------------------------

def constrained(client: openai.OpenAI, **kwargs: Any) -> Any:
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("xgrammar is not installed")
    try:
        return client.chat.completions.create(**kwargs)
    except openai.BadRequestError as e:
        if "structured output is not supported" in e.message or "grammar" in e.message:
            pytest.skip(f"this server has no grammar backend: {e.message}")
        raise


@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_tool_call(client: openai.OpenAI, server: ServerProcess, tool_choice: Any) -> None:
    """Even the random model calls the tool, with arguments that validate against its schema."""
    import jsonschema

    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    # The calls' grammar starts after the thinking, which this model never closes: capped.
    args = {"model": server.model, "messages": QUESTION, "tools": [WEATHER, other], "tool_choice": tool_choice,
            "max_tokens": 128, "temperature": 1.0, "seed": 3, "parallel_tool_calls": False,
            "extra_body": {"thinking_token_budget": 8}}
    r = constrained(client, **args)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed: dict[str, str] = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**args, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            streamed["name"] += tc.function.name or ""
            streamed["arguments"] += tc.function.arguments or ""
    assert streamed == {"name": call.function.name, "arguments": call.function.arguments}


@pytest.mark.timeout(TIMEOUT)
def test_tokenize_renders_tools(server: ServerProcess, hf_tokenizer: Any) -> None:
    r = httpx.post(server.http + "/tokenize", json={"messages": QUESTION, "tools": [WEATHER]}, timeout=TIMEOUT)
    assert r.json()["count"] == rendered_len(hf_tokenizer, QUESTION, tools=[WEATHER])
    info = httpx.get(server.http + "/get_server_info", timeout=TIMEOUT).json()  # SGLang's names
    assert (info["tool_call_parser"], info["reasoning_parser"]) == ("qwen", "qwen3")
