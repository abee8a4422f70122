"""Client requests as the tokenizer process accepts them, validated before anything is sent on.

The same `GenerateRequest` comes from the ZMQ client endpoint and from the HTTP API, so both
are checked by the same rules and fail with the same messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from minisgl_mp.message.codec import WireError, unpack_ids
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.tokenizer.errors import RequestError
from minisgl_mp.tokenizer.fields import check_extra_fields

MAX_RID_CHARS = 128
# apply_chat_template's own arguments: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                                    "return_tensors", "chat_template", "tools", "documents", "padding",
                                    "truncation", "max_length", "continue_final_message", "tokenizer_kwargs"})
ADMIN_COMMANDS = ("stats", "flush_cache", "check_health", "ping")


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of text, input_ids and messages is set."""

    rid: str | None
    params: SamplingParams
    stream: bool = False
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # Extra variables for the chat template, e.g. {"enable_thinking": False} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's tools ({"type": "function", "function": {...}}), for the chat template.
    tools: list[dict[str, Any]] | None = None


def check_rid(rid: Any) -> str | None:
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
        raise RequestError(f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters", param="rid")
    return rid


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise RequestError(f"{where}.content: only text parts are supported", param="messages")
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string", param="messages")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with each call's arguments (JSON text in OpenAI's
    messages) as the object chat templates expect, as SGLang passes them."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"arguments\": ...}}", param="messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be valid JSON",
                                   param="messages") from None
        if not isinstance(args, dict):
            raise RequestError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", param="messages")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's chat messages, as the chat template receives them: text content, and for
    tool use an assistant's `tool_calls` (its content may then be null) and `role: "tool"`
    results with their `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'", param="messages")
        content = _text(m.get("content"), where)
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise RequestError(f"{where}: only assistant messages have tool_calls", param="messages")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if content is None and "tool_calls" not in msg:
            raise RequestError(f"{where}.content must be a string (null only beside tool_calls)", param="messages")
        for name in ("name", "tool_call_id", "reasoning_content"):
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise RequestError(f"{where}.{name} must be a string", param="messages")
                msg[name] = m[name]
        out.append(msg)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI's `tools`: function definitions with a unique name and a JSON-schema object as
    `parameters`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if name in names:
            raise RequestError(f"tools[{i}]: the function {name!r} is defined twice", param="tools")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return tools or None


def check_template_kwargs(kwargs: Any) -> dict[str, Any] | None:
    """chat_template_kwargs: variables for the chat template, none of apply_chat_template's own."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    return kwargs


def check_input_ids(ids: Any, param: str = "input_ids") -> list[int]:
    if isinstance(ids, bytes):
        try:
            ids = unpack_ids(ids)
        except WireError as e:
            raise RequestError(f"{param}: {e}", param=param) from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(f"{param} must be a list of integers (or packed int32 bytes)", param=param)
    return ids


# SGLang's names for our sampling parameters; both are accepted.
SGLANG_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                      "no_stop_trim": "include_stop_str_in_output"}
SAMPLING_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams)) - {"logprob_start_len"}


def make_params(d: Any, default_max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from a client's `sampling_params`, in our names or SGLang's (null values
    are left at their defaults); unknown names are ignored and logged once."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise RequestError(f"sampling_params must be an object, got {type(d).__name__}", param="sampling_params")
    known = {k: v for k, v in d.items() if k in SAMPLING_PARAM_NAMES or k in SGLANG_PARAM_NAMES}
    check_extra_fields({k: v for k, v in d.items() if k not in known}, (), where="sampling_params.")
    out: dict[str, Any] = {}
    for name, value in known.items():
        ours = SGLANG_PARAM_NAMES.get(name, name)
        if value is None:
            continue
        if ours in out:
            raise RequestError(f"sampling_params sets {ours} twice (as {ours} and as its SGLang name)",
                               param="sampling_params")
        out[ours] = value
    if default_max_tokens is not None:
        out.setdefault("max_tokens", default_max_tokens)
    try:
        return SamplingParams.from_dict(out)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), param="sampling_params") from None


GENERATE_FIELDS = frozenset({"rid", "text", "input_ids", "messages", "sampling_params", "stream",
                             "chat_template_kwargs"})


def parse_generate(d: dict[str, Any], default_max_tokens: int | None = None) -> GenerateRequest:
    """The native request of the ZMQ endpoint: one prompt; unknown fields are ignored."""
    check_extra_fields(d, GENERATE_FIELDS)
    prompts = [k for k in ("text", "input_ids", "messages") if d.get(k) is not None]
    if len(prompts) != 1:
        raise RequestError("give exactly one of 'text', 'input_ids' and 'messages'")
    stream = d.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    text = d.get("text")
    if text is not None and not isinstance(text, str):
        raise RequestError("text must be a string", param="text")
    return GenerateRequest(
        rid=check_rid(d.get("rid")),
        params=make_params(d.get("sampling_params"), default_max_tokens),
        stream=stream,
        text=text,
        input_ids=check_input_ids(d["input_ids"]) if d.get("input_ids") is not None else None,
        messages=check_messages(d["messages"]) if d.get("messages") is not None else None,
        chat_template_kwargs=check_template_kwargs(d.get("chat_template_kwargs")),
    )
