"""What the parsers share: the records they produce and finding a tag that may be cut off."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is JSON text (an object), as OpenAI sends it."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first piece of call `index` names it (`name` set,
    `arguments` ""), the next ones carry fragments of its arguments."""

    index: int
    name: str | None
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (but not all of it): text
    that may become `tag` once the next delta arrives, so it must be held back."""
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i >= 0:  # leftmost first: the longest candidate
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0
