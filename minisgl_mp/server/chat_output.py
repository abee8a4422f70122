"""A chat response's text as its OpenAI message: reasoning split off (`--reasoning-parser`),
then tool calls (`--tool-call-parser`, or the JSON array of a `required` / named tool_choice),
the rest as content. `ChatOutput` does it for one choice, whole (`message`) or streamed
(`feed` each text delta, then `finish`); both give the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_mp.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from minisgl_mp.server.parsers.constrained_calls import parse_calls
from minisgl_mp.server.parsers.markup import ToolCall, ToolCallDelta, new_call_id


@dataclass(frozen=True)
class ChatOutputSpec:
    """Which parsers a request's choices run (from the launch flags and the request)."""

    tool_parser: str | None = None  # parse tool-call markup (tool_choice auto, with tools)
    tool_names: tuple[str, ...] = ()
    constrained_calls: bool = False  # tool_choice required / named: the output is a JSON array of calls
    parallel_tool_calls: bool = True
    reasoning_parser: str | None = None  # None: no split (no parser, or separate_reasoning false)
    in_reasoning: bool = False  # thinking is on: the output starts inside the reasoning
    stream_reasoning: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tool_parser or self.constrained_calls or self.reasoning_parser)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
        if self.content:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


class ChatOutput:
    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self.reasoning = (None if spec.reasoning_parser is None else
                          REASONING_PARSERS[spec.reasoning_parser](spec.in_reasoning, spec.stream_reasoning))
        self.tools = (None if spec.tool_parser is None or spec.constrained_calls else
                      TOOL_CALL_PARSERS[spec.tool_parser](spec.tool_names))
        self.has_calls = False
        self._constrained_text: list[str] = []

    def finish_reason(self, reason: str | None) -> str | None:
        """A response that calls tools finishes with "tool_calls" (when it stopped by itself)."""
        return "tool_calls" if self.has_calls and reason == "stop" else reason

    # ---- whole -------------------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        calls: list[ToolCall] = []
        if self.spec.constrained_calls:
            parsed = parse_calls(text)
            if parsed is not None:
                calls, text = parsed, ""
        elif self.tools is not None:
            text, calls = self.tools.parse(text)
        if not self.spec.parallel_tool_calls:
            calls = calls[:1]
        self.has_calls = bool(calls)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message

    # ---- streamed ----------------------------------------------------------------------------
    def feed(self, text: str) -> ChatDelta:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
        return self._tool_stage(reasoning, text, finished=False)

    def finish(self) -> ChatDelta:
        reasoning, text = "", ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish()
        return self._tool_stage(reasoning, text, finished=True)

    def _tool_stage(self, reasoning: str, text: str, finished: bool) -> ChatDelta:
        pieces: list[ToolCallDelta] = []
        if self.spec.constrained_calls:
            # The array is read once whole: until then it may still turn out not to be one.
            self._constrained_text.append(text)
            text = ""
            if finished:
                whole = "".join(self._constrained_text)
                calls = parse_calls(whole)
                if calls is None:
                    text = whole
                else:
                    for i, c in enumerate(calls):
                        pieces += [ToolCallDelta(i, c.name, ""), ToolCallDelta(i, None, c.arguments)]
        elif self.tools is not None and (text or finished):
            text, pieces = self.tools.feed(text)
            if finished:
                rest, more = self.tools.finish()
                text, pieces = text + rest, pieces + more
        if not self.spec.parallel_tool_calls:
            pieces = [p for p in pieces if p.index == 0]
        return ChatDelta(reasoning, text, self._delta_calls(pieces) or None)

    def _delta_calls(self, pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
        """OpenAI's delta.tool_calls: one entry per call; a call's first entry has its id and name."""
        out: dict[int, dict[str, Any]] = {}
        for p in pieces:
            self.has_calls = True
            entry = out.get(p.index)
            if entry is None:
                entry = out[p.index] = {"index": p.index, "function": {"arguments": ""}}
            if p.name is not None:
                entry.update(id=new_call_id(), type="function")
                entry["function"]["name"] = p.name
            entry["function"]["arguments"] += p.arguments
        return list(out.values())
