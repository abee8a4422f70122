"""What a chat request's tool and reasoning options mean for its prompt, its sampling and the
parsers of its output, decided as SGLang decides them."""

from __future__ import annotations

import json
from typing import Any

from minisgl_mp.server.chat_output import ChatOutputSpec
from minisgl_mp.server.http_io import HttpError, opt_bool
from minisgl_mp.server.parsers.constrained_calls import calls_schema
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import check_tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """OpenAI's tool_choice as ("none" | "auto" | "required" | "named", the named function)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise HttpError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', param="tool_choice")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise HttpError(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        return "named", name
    if choice not in ("none", "auto", "required"):
        raise HttpError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                        param="tool_choice")
    if choice == "required" and not tools:
        raise HttpError('tool_choice "required" needs tools', param="tool_choice")
    return choice, None


def grammar_backend(manager: TokenizerManager) -> str:
    """The grammar backend constrained decoding runs on ("none": this server has none)."""
    # NOTE: --grammar-backend comes with structured output (issue 16, items 1-2), built beside
    # this; read by name until the two meet, on whichever config holds the flag.
    config = manager.config
    return getattr(config.engine, "grammar_backend", None) or getattr(config.server, "grammar_backend", None) or "none"


def model_thinks(manager: TokenizerManager, template_kwargs: dict[str, Any] | None) -> bool:
    """A chat answer opens inside the model's thinking: the server knows how it thinks
    (--reasoning-parser) and the request does not turn thinking off (Qwen3's enable_thinking)."""
    thinking_off = (template_kwargs or {}).get("enable_thinking") is False
    return manager.config.server.reasoning_parser is not None and not thinking_off


def tool_options(body: dict[str, Any], manager: TokenizerManager, template_kwargs: dict[str, Any] | None
                  ) -> tuple[list[dict[str, Any]] | None, str | None, ChatOutputSpec]:
    """(the tools the chat template shows, the JSON schema that constrains the output, the
    parsers of the output), as SGLang decides them: tool_choice none hides the tools; a named
    function shows only that one; required and named constrain the output to an array of calls."""
    server = manager.config.server
    tools = check_tools(body.get("tools"))
    choice, named = _tool_choice(body, tools)
    parallel = opt_bool(body, "parallel_tool_calls", default=True)
    separate_reasoning = opt_bool(body, "separate_reasoning", default=True)
    stream_reasoning = opt_bool(body, "stream_reasoning", default=True)
    shown = None if choice == "none" else tools
    schema = None
    if choice in ("required", "named"):
        shown = [t for t in tools or () if named is None or t["function"]["name"] == named]
        if grammar_backend(manager) == "none":
            what = '"required"' if named is None else f"naming {named!r}"
            raise HttpError(f"tool_choice {what} constrains the output, but structured output is not supported: "
                            "this server has no grammar backend (--grammar-backend)", param="tool_choice")
        try:
            schema = json.dumps(calls_schema([t["function"] for t in shown], parallel))
        except ValueError as e:
            raise HttpError(str(e), param="tools") from None
    spec = ChatOutputSpec(
        tool_parser=server.tool_call_parser if choice == "auto" and tools else None,
        tool_names=tuple(t["function"]["name"] for t in tools or ()),
        constrained_calls=schema is not None,
        parallel_tool_calls=parallel,
        reasoning_parser=server.reasoning_parser if separate_reasoning else None,
        # A constrained output thinks first too: its grammar starts after the thinking.
        in_reasoning=model_thinks(manager, template_kwargs),
        stream_reasoning=stream_reasoning)
    return shown, schema, spec
