"""Clients of the ZMQ endpoint: `Client` (blocking) and `AsyncClient` (asyncio).

    from minisgl_mp.client import Client
    with Client("tcp://127.0.0.1:30001") as c:
        print(c.generate("Hello", sampling_params={"max_tokens": 16})["text"])
        for chunk in c.stream("Hello"):
            print(chunk["text"], end="")

Each call gets its own request id; replies are routed by it, so one AsyncClient can carry many
requests at once. Error replies raise `ServerError`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

DEFAULT_ENDPOINT = "tcp://127.0.0.1:30001"


class ServerError(RuntimeError):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('type')}: {error.get('message')}")
        self.error = error


def _request(rid: str, text: str | None, input_ids: list[int] | None, messages: list[dict[str, Any]] | None,
             sampling_params: dict[str, Any] | None, stream: bool, api_key: str | None) -> bytes:
    req: dict[str, Any] = {"rid": rid, "sampling_params": sampling_params or {}, "stream": stream}
    if text is not None:
        req["text"] = text
    if input_ids is not None:
        req["input_ids"] = list(input_ids)
    if messages is not None:
        req["messages"] = messages
    if api_key is not None:
        req["api_key"] = api_key
    return msgpack.packb(req, use_bin_type=True)


def _check(reply: dict[str, Any]) -> dict[str, Any]:
    if "error" in reply:
        raise ServerError(reply["error"])
    return reply


class Client:
    """Blocking client. Not thread-safe: use one per thread, or AsyncClient for concurrency."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, api_key: str | None = None,
                 timeout: float | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.api_key = api_key
        self.timeout_ms = None if timeout is None else int(timeout * 1000)
        self._pending: dict[Any, deque[dict[str, Any]]] = defaultdict(deque)

    def _recv_for(self, rid: str) -> dict[str, Any]:
        while True:
            if self._pending[rid]:
                return self._pending[rid].popleft()
            if self._pending[None]:  # an error the server could not tie to a request id
                return self._pending[None].popleft()
            if self.timeout_ms is not None and not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no reply for request {rid} within {self.timeout_ms / 1000:.1f}s")
            reply = msgpack.unpackb(self.sock.recv(), raw=False)
            self._pending[reply.get("rid")].append(reply)

    def stream(self, text: str | None = None, *, input_ids: list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, sampling_params: dict[str, Any] | None = None,
               rid: str | None = None) -> Iterator[dict[str, Any]]:
        rid = rid or uuid.uuid4().hex
        self.sock.send(_request(rid, text, input_ids, messages, sampling_params, True, self.api_key))
        try:
            while True:
                reply = _check(self._recv_for(rid))
                yield reply
                if reply.get("finished"):
                    return
        finally:
            self._pending.pop(rid, None)

    def generate(self, text: str | None = None, *, input_ids: list[int] | None = None,
                 messages: list[dict[str, Any]] | None = None, sampling_params: dict[str, Any] | None = None,
                 rid: str | None = None) -> dict[str, Any]:
        rid = rid or uuid.uuid4().hex
        self.sock.send(_request(rid, text, input_ids, messages, sampling_params, False, self.api_key))
        try:
            return _check(self._recv_for(rid))
        finally:
            self._pending.pop(rid, None)

    def abort(self, rid: str) -> None:
        msg: dict[str, Any] = {"rid": rid, "abort": True}
        if self.api_key is not None:
            msg["api_key"] = self.api_key
        self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def admin(self, command: str) -> dict[str, Any]:
        rid = f"admin-{uuid.uuid4().hex}"
        msg: dict[str, Any] = {"rid": rid, "admin": command}
        if self.api_key is not None:
            msg["api_key"] = self.api_key
        self.sock.send(msgpack.packb(msg, use_bin_type=True))
        try:
            return _check(self._recv_for(rid))
        finally:
            self._pending.pop(rid, None)

    def send_raw(self, payload: bytes) -> None:
        """Send arbitrary bytes (for tests of the server's input checks)."""
        self.sock.send(payload)

    def recv_raw(self) -> dict[str, Any]:
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: any number of concurrent requests over one socket."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, api_key: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.api_key = api_key
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        while True:
            # A step's updates of the streams on this socket come as the frames of one message.
            for frame in await self.sock.recv_multipart():
                reply = msgpack.unpackb(frame, raw=False)
                q = self._queues.get(reply.get("rid"))
                if q is not None:
                    q.put_nowait(reply)
                elif reply.get("rid") is None:
                    for q in self._queues.values():
                        q.put_nowait(reply)

    async def stream(self, text: str | None = None, *, input_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None, sampling_params: dict[str, Any] | None = None,
                     rid: str | None = None, stream: bool = True) -> AsyncIterator[dict[str, Any]]:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        rid = rid or uuid.uuid4().hex
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[rid] = q
        try:
            await self.sock.send(_request(rid, text, input_ids, messages, sampling_params, stream, self.api_key))
            while True:
                reply = _check(await q.get())
                yield reply
                if reply.get("finished"):
                    return
        finally:
            self._queues.pop(rid, None)

    async def generate(self, text: str | None = None, **kwargs: Any) -> dict[str, Any]:
        async for reply in self.stream(text, stream=False, **kwargs):
            return reply
        raise RuntimeError("no reply")

    async def abort(self, rid: str) -> None:
        msg: dict[str, Any] = {"rid": rid, "abort": True}
        if self.api_key is not None:
            msg["api_key"] = self.api_key
        await self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)
