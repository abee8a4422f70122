"""`tool_choice: "required"` or a named function, as SGLang does it: the output is constrained
by a JSON schema to an array of calls, `[{"name": ..., "parameters": {...}}, ...]`, whose
`parameters` validate against the function's own schema; the array is then read back into
tool calls. Unlike `auto`, this needs no tool-call parser: the format is the schema's."""

from __future__ import annotations

import json
from typing import Any

from minisgl_mp.server.parsers.markup import ToolCall

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def calls_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of the output for these functions (OpenAI's `function` objects): one
    call or more (exactly one when `parallel` is false)."""
    def one(fn: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                               "parameters": fn.get("parameters") or EMPTY_PARAMETERS},
                "required": ["name", "parameters"]}

    items = one(functions[0]) if len(functions) == 1 else {"anyOf": [one(fn) for fn in functions]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for fn in functions:  # $refs inside parameters point at the root's $defs
        for name, sub in ((fn.get("parameters") or {}).get("$defs") or {}).items():
            if defs.setdefault(name, sub) != sub:
                raise ValueError(f"tools define $defs/{name} twice, differently")
    if defs:
        schema["$defs"] = defs
    return schema


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a constrained output, or None when it is not such an array (cut off by
    max_tokens, say): then it stays the content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)):
            return None
        calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls
