"""The tool-call and reasoning parsers, and the serving layer that runs them, on the text a
model writes: whole and streamed (split between any two characters, or token by token as the
default model's tokenizer cuts it), the streamed pieces must join to the whole response, and
no `<tool_call>` or `<think>` markup may reach the content. No server: the random default
model will not write these tags by itself, so the outputs are fed in as the detokenizer would."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from minisgl_mp.message.messages import TextOut
from minisgl_mp.server.chat_output import ChatOutputSpec
from minisgl_mp.server.fanout import Choice
from minisgl_mp.server.openai_protocol import OpenAIRequest
from minisgl_mp.server.openai_serving import complete, stream
from minisgl_mp.server.parsers import Qwen3ReasoningParser, QwenToolCallParser
from minisgl_mp.server.parsers.constrained_calls import calls_schema, parse_calls
from minisgl_mp.server.parsers.markup import partial_tag_len
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import GenerateRequest, check_messages
from minisgl_mp.sampling_params import SamplingParams

NAMES = ("get_weather", "add")
CALL_1 = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a } and \\" here"}}'
CALL_2 = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
TWO_CALLS = f"Let me look.\n\n<tool_call>\n{CALL_1}\n</tool_call>\n<tool_call>\n{CALL_2}\n</tool_call>"


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        out.append(text[i:i + n])
        i += n
    return out


def stream_tools(text: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = QwenToolCallParser(NAMES)
    content, calls = [], {}
    for piece in [*pieces, None]:
        c, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content.append(c)
        for d in deltas:
            if d.name is not None:
                assert d.index not in calls and d.arguments == ""  # the name comes first, once
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return "".join(content), [tuple(v) for _, v in sorted(calls.items())]


def whole_tools(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = QwenToolCallParser(NAMES).parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def test_partial_tag_len() -> None:
    assert partial_tag_len("abc<tool_", "<tool_call>") == 6
    assert partial_tag_len("abc<tool_call>", "<tool_call>") == 0  # a whole tag is not held
    assert partial_tag_len("x<", "</think>") == 1 and partial_tag_len("x", "</think>") == 0


def test_tool_calls_whole() -> None:
    content, calls = whole_tools(TWO_CALLS)
    assert content == "Let me look."
    assert calls == [("get_weather", json.dumps(json.loads(CALL_1)["arguments"])), ("add", '{"a": 2, "b": 3}')]
    assert json.loads(calls[0][1])["note"] == 'a } and " here'
    assert whole_tools("no calls here\n") == ("no calls here\n", [])


def test_malformed_arguments() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    assert whole_tools(text) == (text, [])
    # Streamed, the arguments went out before they turned out malformed (as in SGLang): the
    # client gets the call with the model's broken arguments, and still no markup as content.
    assert stream_tools(text, splits(text, 0)) == ("", [("add", '{"a": 1,}')])


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"add\" \"arguments\": {}}\n</tool_call>",  # malformed head
    "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",  # not one of the tools
    "<tool_call>\n[1, 2]\n</tool_call> after",  # not a call object
    "before <tool_call>\n{\"name\": \"add\"",  # cut off before the arguments
])
def test_a_block_that_is_not_a_call_stays_content(text: str) -> None:
    assert whole_tools(text) == (text, [])
    for seed in range(20):
        assert stream_tools(text, splits(text, seed)) == (text, [])


def test_calls_and_content_around_them() -> None:
    text = f"A <tool_call>{CALL_2}</tool_call>\nB <tool_call>\n{{\"name\": \"nope\", \"arguments\": {{}}}}\n</tool_call>"
    content, calls = whole_tools(text)
    assert calls == [("add", '{"a": 2, "b": 3}')]
    assert content == 'A \nB <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text", [TWO_CALLS, f"<tool_call>\n{CALL_2}\n</tool_call>", "plain <tool text < > </tool_call>",
                                  f"x<tool_call>{CALL_1}</tool_call>y\n\n<tool_call>{CALL_2}"])
def test_streamed_tool_calls_join_to_the_whole_response(text: str) -> None:
    want = whole_tools(text)
    for seed in range(60):
        assert stream_tools(text, splits(text, seed)) == want
    assert stream_tools(text, list(text)) == want


def test_streaming_never_shows_markup_in_content() -> None:
    parser = QwenToolCallParser(NAMES)
    sent = []
    for ch in TWO_CALLS:
        sent.append(parser.feed(ch)[0])
    sent.append(parser.finish()[0])
    assert "".join(sent) == "Let me look."
    assert not any("<" in s for s in sent)


def test_reasoning_whole() -> None:
    on, off = Qwen3ReasoningParser(in_reasoning=True), Qwen3ReasoningParser(in_reasoning=False)
    assert on.parse("<think>\nplan\n</think>\n\nanswer") == ("\nplan\n", "\n\nanswer")
    # Qwen3's template may open <think> in the prompt: the output then only closes it.
    assert on.parse("plan</think>answer") == ("plan", "answer")
    assert on.parse("still thinking") == ("still thinking", "")  # cut off while thinking
    assert off.parse("answer") == ("", "answer")
    assert off.parse("<think>plan</think>answer") == ("plan", "answer")


@pytest.mark.parametrize("in_reasoning", [True, False])
@pytest.mark.parametrize("text", ["<think>\nplan a < b\n</think>\n\nanswer", "plan</think>answer </think>",
                                  "<thi", "<think>", "no tags at all", "<think>cut off"])
def test_streamed_reasoning_joins_to_the_whole(text: str, in_reasoning: bool) -> None:
    want = Qwen3ReasoningParser(in_reasoning).parse(text)
    for stream_reasoning in (True, False):
        for pieces in [list(text), *(splits(text, seed) for seed in range(20))]:
            parser = Qwen3ReasoningParser(in_reasoning, stream_reasoning)
            outs = [parser.feed(p) for p in pieces] + [parser.finish()]
            assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == want
            assert not any("<think>" in c or "</think>" in r for r, c in outs)
            if not stream_reasoning:  # held back, then sent in one piece
                assert sum(1 for r, _ in outs if r) <= 1


# ---- the serving layer, on outputs as the detokenizer sends them --------------------------------

class FakeManager:
    """Plays back one output, a text delta per TextOut, through the real serving code."""

    def __init__(self, deltas: list[str], finish_reason: str = "stop") -> None:
        self.deltas, self.finish_reason = deltas, finish_reason

    async def generate(self, req: Any, ids: Any = None, rid: Any = None):  # noqa: ANN201
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield TextOut(rid="r", text=text, new_ids=[], finished=last,
                          finish_reason=self.finish_reason if last else None, matched_stop=None,
                          prompt_tokens=3, completion_tokens=i + 1, cached_tokens=0, logprobs=[])


def chat_request(spec: ChatOutputSpec, stream_: bool) -> OpenAIRequest:
    req = GenerateRequest(rid=None, params=SamplingParams(), messages=[{"role": "user", "content": "hi"}])
    choice = Choice(index=0, prompt_index=0, sample_index=0, request=req, ids=[1, 2, 3])
    return OpenAIRequest(chat=True, id="chatcmpl-x", created=0, model="m", n=1, choices=[choice], stream=stream_,
                         include_usage=False, logprobs=False, output=spec)


def serve(spec: ChatOutputSpec, deltas: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the whole response's choice, the stream's chunks' choices)."""
    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        whole = await complete(chat_request(spec, False), FakeManager(deltas), None)
        chunks = [json.loads(raw[len(b"data: "):]) async for raw in stream(chat_request(spec, True), FakeManager(deltas), None)
                  if raw.startswith(b"data: {")]
        return whole["choices"][0], [c["choices"][0] for c in chunks]
    return asyncio.run(run())


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed message put together the way OpenAI's clients do."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for ch in chunks:
        d = ch["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            call = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None and tc["type"] == "function"  # id and name once, first
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            assert call["name"] is not None
            call["arguments"] += tc["function"].get("arguments", "")
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg


@pytest.fixture(scope="module")
def token_pieces(tokenizer_dir: Path) -> Any:
    """text -> its pieces as the default model's tokens decode, one token each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def pieces(text: str) -> list[str]:
        ids = tok.encode(text, add_special_tokens=False)
        for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
            assert text.count(marker) == ids.count(tok.convert_tokens_to_ids(marker))  # one token each
        return [tok.decode([i]) for i in ids]
    return pieces


TOOLS_AND_THINKING = ChatOutputSpec(tool_parser="qwen", tool_names=NAMES, reasoning_parser="qwen3", in_reasoning=True)


def test_served_tool_calls_and_reasoning(token_pieces: Any) -> None:
    text = f"<think>\nThe user wants weather.\n</think>\n\n{TWO_CALLS}"
    for deltas in (token_pieces(text), splits(text, 1), list(text)):
        whole, chunks = serve(TOOLS_AND_THINKING, deltas)
        msg = whole["message"]
        assert whole["finish_reason"] == "tool_calls" and chunks[-1]["finish_reason"] == "tool_calls"
        assert msg["reasoning_content"] == "\nThe user wants weather.\n"
        assert msg["content"] == "\n\nLet me look."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
            ("get_weather", json.loads(CALL_1)["arguments"]), ("add", {"a": 2, "b": 3})]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
        streamed = assemble(chunks)
        assert streamed["content"] == msg["content"] and streamed["reasoning_content"] == msg["reasoning_content"]
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        assert sum(1 for c in chunks if c["finish_reason"] is not None) == 1


def test_served_calls_alone_have_null_content(token_pieces: Any) -> None:
    whole, chunks = serve(TOOLS_AND_THINKING, token_pieces(f"</think>\n\n<tool_call>\n{CALL_2}\n</tool_call>"))
    assert whole["message"]["content"] is None and whole["message"]["reasoning_content"] is None
    assert assemble(chunks)["content"].strip() == ""


def test_served_without_a_call(token_pieces: Any) -> None:
    spec = ChatOutputSpec(tool_parser="qwen", tool_names=NAMES)
    whole, chunks = serve(spec, token_pieces("Just text, <b>bold</b>."))
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == "Just text, <b>bold</b>."
    assert "tool_calls" not in whole["message"] and assemble(chunks)["content"] == "Just text, <b>bold</b>."


def test_served_parallel_tool_calls_false_keeps_the_first(token_pieces: Any) -> None:
    spec = ChatOutputSpec(tool_parser="qwen", tool_names=NAMES, parallel_tool_calls=False)
    whole, chunks = serve(spec, token_pieces(TWO_CALLS))
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in assemble(chunks)["tool_calls"]] == ["get_weather"]


def test_stream_reasoning_false_sends_the_reasoning_once(token_pieces: Any) -> None:
    spec = ChatOutputSpec(reasoning_parser="qwen3", in_reasoning=True, stream_reasoning=False)
    whole, chunks = serve(spec, token_pieces("<think>a long plan in many tokens</think>Answer."))
    assert whole["message"]["reasoning_content"] == "a long plan in many tokens"
    assert [c["delta"]["reasoning_content"] for c in chunks if c["delta"].get("reasoning_content")] == [
        "a long plan in many tokens"]
    assert assemble(chunks)["content"] == "Answer."


def test_a_call_cut_off_by_max_tokens_finishes_with_length() -> None:
    text = f"<tool_call>\n{CALL_2}"  # no end tag: stopped by the length limit, not by the model
    whole = asyncio.run(complete(chat_request(TOOLS_AND_THINKING, False), FakeManager([text], "length"), None))
    assert whole["choices"][0]["finish_reason"] == "length"


def test_constrained_calls(token_pieces: Any) -> None:
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}, {"name": "add"}]
    schema = calls_schema(functions, parallel=False)
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [
        ["get_weather"], ["add"]]
    assert "maxItems" not in calls_schema(functions[:1], parallel=True)
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {}}]'
    assert [(c.name, json.loads(c.arguments)) for c in parse_calls(out)] == [("get_weather", {"city": "Paris"}),
                                                                             ("add", {})]
    assert parse_calls('[{"name": "add", "parameters": {"a"') is None  # cut off: stays content
    spec = ChatOutputSpec(constrained_calls=True, tool_names=("get_weather", "add"), reasoning_parser="qwen3")
    whole, chunks = serve(spec, token_pieces(out))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    streamed = assemble(chunks)
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]


def test_tool_history_renders_as_transformers_renders_it(tokenizer_dir: Path) -> None:
    """Assistant tool_calls (arguments as OpenAI's JSON text, content null) and tool results
    give the prompt transformers gives for the same history with the arguments as objects
    (what Qwen's template expects, and what SGLang hands it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    openai_history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    ]
    as_objects = [
        openai_history[0], openai_history[1],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        openai_history[3], {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    config = SimpleNamespace(model=SimpleNamespace(context_len=4096, vocab_size=8192))
    manager = TokenizerManager(config, tok, [None], None)  # type: ignore[arg-type]
    for kwargs in ({}, {"enable_thinking": False}):
        req = GenerateRequest(rid=None, params=SamplingParams(max_tokens=1), messages=check_messages(openai_history),
                              tools=tools, chat_template_kwargs=kwargs or None)
        ids = asyncio.run(manager.prompt_ids(req))
        text = tok.apply_chat_template(as_objects, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ids == tok.encode(text, add_special_tokens=False)
        rendered = tok.decode(ids)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in rendered
        assert "<tool_response>\nrain\n</tool_response>" in rendered and '"description": "Weather for a city"' in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false


def test_parser_flags_take_sglang_and_vllm_names() -> None:
    from minisgl_mp.server_config import ServerArgs

    for name in ("qwen", "qwen25", "hermes"):
        assert ServerArgs(tool_call_parser=name, reasoning_parser="qwen3").tool_call_parser == name
    with pytest.raises(ValueError, match="tool_call_parser must be one of qwen, qwen25, hermes, got 'llama3'"):
        ServerArgs(tool_call_parser="llama3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3"):
        ServerArgs(reasoning_parser="deepseek-r1")
