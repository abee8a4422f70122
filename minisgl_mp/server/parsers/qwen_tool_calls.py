"""`--tool-call-parser qwen` (`qwen25`, `hermes`): Qwen's tool-call blocks,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

as OpenAI tool calls. A block is a call when its JSON object names a function of the request's
`tools` first and then gives `arguments`, an object; `arguments` is sent as the model wrote it.
Anything else (malformed JSON, an unknown function) stays in the content, markup and all, as
SGLang leaves it. The content is the text outside the calls; when there are calls, whitespace
at its end is dropped (what separates the blocks).

Streaming holds back text that may be the start of `<tool_call>`, and a block until its head
(`{"name": ..., "arguments": `) is complete; then it sends the name and streams the arguments
as they come. NOTE: a block whose arguments turn out malformed after they began to stream (or
that max_tokens cuts off) cannot be taken back: the client has received a partial call, which
the non-streamed response would have left in the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from minisgl_mp.server.parsers.markup import ToolCall, ToolCallDelta, partial_tag_len

START, END = "<tool_call>", "</tool_call>"
# The block's head, up to the arguments object's opening brace (not consumed).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}\s*")


class QwenToolCallParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = frozenset(tool_names)
        self._state = "text"  # text -> head -> arguments -> tail -> text; raw: a block kept as text
        self._buf = ""
        self._held_space = ""  # trailing whitespace of the content, sent once more text follows
        self._calls = 0
        self._args = _ObjectScanner()

    def _name(self, head: re.Match[str]) -> str | None:
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            return None
        return name if name in self.tool_names else None

    # ---- one shot ----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            end = text.find(END, start + len(START))
            body_end = len(text) if end < 0 else end
            call = self._call(text[start + len(START):body_end])
            content.append(text[pos:start])
            if call is None:
                content.append(text[start:body_end + (0 if end < 0 else len(END))])
            else:
                calls.append(call)
            pos = body_end + (0 if end < 0 else len(END))
        content.append(text[pos:])
        joined = "".join(content)
        return (joined.rstrip() if calls else joined), calls

    def _call(self, body: str) -> ToolCall | None:
        head = _HEAD.match(body)
        name = None if head is None else self._name(head)
        if head is None or name is None:
            return None
        try:
            _, args_end = json.JSONDecoder().raw_decode(body, head.end())
        except json.JSONDecodeError:
            return None
        if _TAIL.fullmatch(body, args_end) is None:
            return None
        return ToolCall(name, body[head.end():args_end])

    # ---- streaming ---------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, call pieces) to send for this delta."""
        self._buf += delta
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while self._step(content, pieces):
            pass
        return self._content("".join(content)), pieces

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is still held back when the output ends."""
        rest, self._buf = self._buf, ""
        if self._state in ("head", "raw"):
            rest = START + rest if self._state == "head" else rest
        elif self._state != "text":
            rest = ""  # the end of a call whose arguments were already sent
        self._state = "text"
        text = self._held_space + rest
        self._held_space = ""
        return (text.rstrip() if self._calls else text), []

    def _content(self, text: str) -> str:
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        return kept

    def _step(self, content: list[str], pieces: list[ToolCallDelta]) -> bool:
        """Consume what can be decided of the buffer; True when the state changed."""
        buf = self._buf
        if self._state == "text":
            start = buf.find(START)
            if start < 0:
                keep = partial_tag_len(buf, START)
                content.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            content.append(buf[:start])
            self._buf, self._state = buf[start + len(START):], "head"
            return True
        if self._state == "head":
            head = _HEAD.match(buf)
            if head is not None and len(buf) > head.end():
                name = self._name(head)
                if name is not None:
                    pieces.append(ToolCallDelta(self._calls, name, ""))
                    self._buf, self._state, self._args = buf[head.end():], "arguments", _ObjectScanner()
                    return True
            if (head is not None and len(buf) > head.end()) or END in buf:
                # Not a call of ours: the block goes out as text.
                content.append(START)
                self._state = "raw"
                return True
            return False
        if self._state == "arguments":
            used = self._args.feed(buf)
            if used:
                pieces.append(ToolCallDelta(self._calls, None, buf[:used]))
            self._buf = buf[used:]
            if self._args.done:
                self._state, self._calls = "tail", self._calls + 1
                return True
            return False
        end = buf.find(END)  # tail or raw: up to the end tag
        if end < 0:
            keep = partial_tag_len(buf, END)
            if self._state == "raw":
                content.append(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if self._state == "raw":
            content.append(buf[:end + len(END)])
        self._buf, self._state = buf[end + len(END):], "text"
        return True


class _ObjectScanner:
    """Finds where a JSON object ends in text that arrives in pieces (brackets outside strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the object (all of them until it ends)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)
