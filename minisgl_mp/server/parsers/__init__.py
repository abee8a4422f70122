"""Parsers of a chat model's output markup, chosen by name at launch (SGLang's names):
`--tool-call-parser` turns tool-call blocks into OpenAI `tool_calls`, `--reasoning-parser`
moves the model's thinking into `reasoning_content`.

Every parser has a one-shot form (`parse`, for whole responses) and a streaming form (`feed`
each text delta, then `finish`) that produce the same result when their pieces are joined, and
a streaming parser never lets a tag split over two deltas reach the client as text.
"""

from __future__ import annotations

from minisgl_mp.server.parsers.qwen3_reasoning import Qwen3ReasoningParser
from minisgl_mp.server.parsers.qwen_tool_calls import QwenToolCallParser

# Qwen2.5 and Qwen3 write Hermes-style `<tool_call>{json}</tool_call>` blocks: SGLang calls
# the format qwen25 (also qwen), vLLM hermes.
TOOL_CALL_PARSERS = {"qwen": QwenToolCallParser, "qwen25": QwenToolCallParser, "hermes": QwenToolCallParser}
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
