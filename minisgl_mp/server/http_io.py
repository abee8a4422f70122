"""HTTP plumbing shared by every endpoint: OpenAI's error shape, reading a bounded JSON body,
the bearer-key check, and responses that notice a client going away.

A client that disconnects must not keep its requests running: both `SSEResponse` and
`until_disconnect` watch the ASGI `http.disconnect` event and cancel the work, which closes the
manager's generators and so aborts the requests in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from minisgl_mp.tokenizer.requests import RequestError

T = TypeVar("T")

# RequestError.kind -> OpenAI's error "type".
_ERROR_TYPES = {"invalid_request": "invalid_request_error", "unauthorized": "authentication_error",
                "not_found": "not_found_error", "payload_too_large": "invalid_request_error",
                "overloaded": "server_overloaded", "unavailable": "service_unavailable",
                "internal": "internal_error"}


class HttpError(RequestError):
    """A RequestError with OpenAI's machine-readable `code` (e.g. "model_not_found")."""

    def __init__(self, message: str, kind: str = "invalid_request", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message, kind=kind, param=param, retry_after=retry_after)
        self.code = code


def opt_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """An optional boolean field of a request body: `default` when absent or null, else a 400
    unless it is true or false."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise HttpError(f"{name} must be true or false, got {v!r}", param=name)
    return v


def error_body(err: RequestError) -> dict[str, Any]:
    code = getattr(err, "code", None) or err.kind
    return {"error": {"message": err.message, "type": _ERROR_TYPES.get(err.kind, "internal_error"),
                      "param": err.param, "code": code}}


def error_response(err: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# JSON has no infinities: a token of probability 0 gets OpenAI's stand-in log-probability.
IMPOSSIBLE_LOGPROB = -9999.0


def json_logprob(x: float) -> float:
    return x if math.isfinite(x) else IMPOSSIBLE_LOGPROB


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 over `max_bytes` (declared or actual), else 400 if it is not
    UTF-8 JSON holding an object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise HttpError(f"invalid Content-Length header {declared!r}")
        if int(declared) > max_bytes:
            raise HttpError(f"request body of {int(declared)} bytes exceeds the limit of {max_bytes} bytes",
                            kind="payload_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise HttpError(f"request body exceeds the limit of {max_bytes} bytes", kind="payload_too_large")
    except ClientDisconnect:  # nobody will read the answer; this only keeps it out of the error log
        raise HttpError("the client disconnected while sending the body") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from None
    if not text.strip():
        raise HttpError("the request body is empty: a JSON object is expected")
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise HttpError("the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers past Python's digit limit
        raise HttpError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise HttpError(f"the request body must be a JSON object, got {type(d).__name__}")
    return d


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise HttpError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                        kind="unauthorized", code="invalid_api_key")


async def _wait_disconnect(receive: Receive) -> None:
    # The body has been read by now, so the next message is the disconnect (uvicorn answers
    # http.disconnect once the connection closes).
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race(work: Awaitable[T], receive: Receive) -> tuple[bool, asyncio.Future[T]]:
    """Run `work` until it ends or the client disconnects; (client gone, the work's future)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done() and not watcher.cancelled() and not task.done()
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return gone, task


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None when the client went away first (the work is cancelled)."""
    gone, task = await _race(work, request.receive)
    return None if gone else task.result()


class SSEResponse(Response):
    """A server-sent-event stream of ready-made `data:` lines. When the client disconnects the
    event iterator is cancelled (and closed), whatever it was waiting on."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        _, task = await _race(self._pump(send), receive)
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def _pump(self, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
