"""Client requests as the tokenizer process accepts them, validated before anything is sent on.

The same `GenerateRequest` comes from the ZMQ client endpoint and from the HTTP API, so both
are checked by the same rules and fail with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl_mp.message.codec import WireError, unpack_ids
from minisgl_mp.sampling_params import SamplingParams

MAX_RID_CHARS = 128
ADMIN_COMMANDS = ("stats", "flush_cache", "check_health", "ping")


class RequestError(Exception):
    """A request that fails; `kind` maps to an HTTP status and an OpenAI error type."""

    STATUS = {"invalid_request": 400, "unauthorized": 401, "not_found": 404,
              "payload_too_large": 413, "overloaded": 503, "unavailable": 503, "internal": 500}

    def __init__(self, message: str, kind: str = "invalid_request", param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After with a 503

    @property
    def status(self) -> int:
        return self.STATUS.get(self.kind, 500)


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of text, input_ids and messages is set."""

    rid: str | None
    params: SamplingParams
    stream: bool = False
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


def check_rid(rid: Any) -> str | None:
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
        raise RequestError(f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters", param="rid")
    return rid


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def check_input_ids(ids: Any, param: str = "input_ids") -> list[int]:
    if isinstance(ids, bytes):
        try:
            ids = unpack_ids(ids)
        except WireError as e:
            raise RequestError(f"{param}: {e}", param=param) from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(f"{param} must be a list of integers (or packed int32 bytes)", param=param)
    return ids


def make_params(d: Any) -> SamplingParams:
    if isinstance(d, dict) and "no_stop_trim" in d:  # SGLang's name for include_stop_str_in_output
        d = {k: v for k, v in d.items() if k != "no_stop_trim"} | {"include_stop_str_in_output": d["no_stop_trim"]}
    try:
        return SamplingParams.from_dict({} if d is None else d)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), param="sampling_params") from None


def parse_generate(d: dict[str, Any]) -> GenerateRequest:
    """The native request of the ZMQ endpoint (and of HTTP /generate, in SGLang's shape)."""
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
        params=make_params(d.get("sampling_params")),
        stream=stream,
        text=text,
        input_ids=check_input_ids(d["input_ids"]) if d.get("input_ids") is not None else None,
        messages=check_messages(d["messages"]) if d.get("messages") is not None else None,
    )
