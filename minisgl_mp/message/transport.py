"""Typed ZMQ queues: one PUSH/PULL pair per channel, blocking and asyncio flavours.

A message that fails to decode is logged and dropped; it never stops the receiving process.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio

from minisgl_mp.message.codec import Channel, WireError

logger = logging.getLogger(__name__)


def _setup(sock: zmq.Socket, channel: Channel, addr: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, channel.max_bytes)
    (sock.bind if bind else sock.connect)(addr)


class PushQueue:
    def __init__(self, ctx: zmq.Context, addr: str, channel: Channel, bind: bool = False) -> None:
        self.channel = channel
        self.sock = ctx.socket(zmq.PUSH)
        _setup(self.sock, channel, addr, bind)

    def put(self, msg: Any) -> None:
        self.sock.send(self.channel.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class PullQueue:
    def __init__(self, ctx: zmq.Context, addr: str, channel: Channel, bind: bool = True) -> None:
        self.channel = channel
        self.sock = ctx.socket(zmq.PULL)
        _setup(self.sock, channel, addr, bind)

    def get(self, timeout_ms: int | None = None) -> Any | None:
        """Block until a valid message arrives (or `timeout_ms` passes: None)."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            msg = self._decode(self.sock.recv())
            if msg is not None:
                return msg

    def get_nowait(self) -> Any | None:
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            msg = self._decode(data)
            if msg is not None:
                return msg

    def _decode(self, data: bytes) -> Any | None:
        try:
            return self.channel.decode(data)
        except WireError as e:
            logger.error("dropped a message on channel %s: %s", self.channel.name, e)
            return None

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPushQueue:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, channel: Channel, bind: bool = False) -> None:
        self.channel = channel
        self.sock = ctx.socket(zmq.PUSH)
        _setup(self.sock, channel, addr, bind)

    async def put(self, msg: Any) -> None:
        await self.sock.send(self.channel.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPullQueue:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, channel: Channel, bind: bool = True) -> None:
        self.channel = channel
        self.sock = ctx.socket(zmq.PULL)
        _setup(self.sock, channel, addr, bind)

    async def get(self) -> Any:
        while True:
            data = await self.sock.recv()
            try:
                return self.channel.decode(data)
            except WireError as e:
                logger.error("dropped a message on channel %s: %s", self.channel.name, e)

    def close(self) -> None:
        self.sock.close(linger=0)
