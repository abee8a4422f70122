"""`--reasoning-parser qwen3`: Qwen3's `<think>…</think>` as `reasoning_content`.

Qwen3 thinks by default and its chat template may already put `<think>` in the prompt, so the
output may hold only the closing `</think>`. As SGLang's Qwen3 detector does, with thinking on
(`in_reasoning`: `enable_thinking` not false) the output is reasoning from its first character
(a leading `<think>` dropped) until `</think>`, and an output with no `</think>` is all
reasoning (it was cut off while thinking). With thinking off, only an output that opens with
`<think>` has reasoning. The text after `</think>` is the content, unchanged.
"""

from __future__ import annotations

from minisgl_mp.server.parsers.markup import partial_tag_len

START, END = "<think>", "</think>"


class Qwen3ReasoningParser:
    """One response's parser. `stream_reasoning=False` (SGLang's option) holds the reasoning
    back while streaming and sends it in one piece once it ends."""

    def __init__(self, in_reasoning: bool, stream_reasoning: bool = True) -> None:
        self.forced = in_reasoning
        self.stream_reasoning = stream_reasoning
        self._state = "start"  # start (a <think> may open the output) -> reasoning -> content
        self._buf = ""
        self._held_reasoning = ""

    # ---- one shot ----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        if text.startswith(START):
            text = text[len(START):]
        elif not self.forced:
            return "", text
        reasoning, end, content = text.partition(END)
        return reasoning, content if end else ""

    # ---- streaming ---------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) to send for this delta."""
        self._buf += delta
        if self._state == "start":
            if START.startswith(self._buf) and self._buf != START:
                return "", ""  # may still become <think>
            if self._buf.startswith(START):
                self._buf = self._buf[len(START):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.forced else "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
            return "", content
        reasoning, end, content = self._buf.partition(END)
        if end:
            self._state, self._buf = "content", ""
            return self._release(reasoning, done=True), content
        keep = partial_tag_len(self._buf, END)
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return self._release(reasoning, done=False), ""

    def finish(self) -> tuple[str, str]:
        """What is still held back when the output ends."""
        rest, self._buf = self._buf, ""
        if self._state == "start":
            self._state = "reasoning" if self.forced or rest == START else "content"
            rest = "" if rest == START else rest
        if self._state == "content":
            return "", rest
        return self._release(rest, done=True), ""

    def _release(self, reasoning: str, done: bool) -> str:
        if self.stream_reasoning:
            return reasoning
        self._held_reasoning += reasoning
        if not done:
            return ""
        out, self._held_reasoning = self._held_reasoning, ""
        return out
