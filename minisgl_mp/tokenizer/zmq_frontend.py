"""The ZMQ client endpoint: a ROUTER socket speaking msgpack maps, so a client in any language
with ZMQ and msgpack can use the engine. The protocol is documented in README.md.

A client is a DEALER socket; its identity routes replies back. When a reply cannot be delivered
because the client disconnected (ROUTER_MANDATORY reports it unroutable) or stopped reading (its
queue stays full), its request is aborted, so it can neither leak KV pages nor stall anyone.

A client that streams many requests over one socket gets each step's updates of all of them
as the frames of one multipart message, one frame (one msgpack map) per update: one send per
client and step instead of one per stream, which on a few cores is most of what streaming
costs this process. A client that reads frame by frame (`recv`) sees the same sequence of
maps either way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from minisgl_mp.message.codec import WireError, unpack_map
from minisgl_mp.message.messages import TextOut
from minisgl_mp.tokenizer.manager import TokenizerManager, finish_or_cancel
from minisgl_mp.tokenizer.requests import ADMIN_COMMANDS, RequestError, check_rid, parse_generate

logger = logging.getLogger("minisgl_mp.tokenizer.zmq")


class ClientGone(Exception):
    """The reply cannot be delivered: the client disconnected or stopped reading."""


def error_reply(rid: Any, err: RequestError) -> dict[str, Any]:
    return {"rid": rid if isinstance(rid, str) else None,
            "error": {"message": err.message, "type": err.kind, "param": err.param}}


def output_reply(rid: str, out: TextOut, text: str, token_ids: list[int], logprobs: list[Any]) -> dict[str, Any]:
    reply: dict[str, Any] = {"rid": rid, "text": text, "token_ids": token_ids, "finished": out.finished}
    if logprobs:
        reply["logprobs"] = [{"logprob": e.logprob, "top_ids": e.top_ids, "top_logprobs": e.top_logprobs}
                             for e in logprobs]
    if out.finished:
        reply.update(finish_reason=out.finish_reason, matched_stop=out.matched_stop,
                     usage={"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                            "cached_tokens": out.cached_tokens})
        if out.spec_verify_ct:
            reply["usage"].update(spec_verify_ct=out.spec_verify_ct, spec_accept_length=out.spec_accept_length)
    return reply


class ZmqFrontend:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, manager: TokenizerManager,
                 max_payload_bytes: int, api_key: str | None) -> None:
        self.manager = manager
        self.max_payload_bytes = max_payload_bytes
        self.api_key = api_key
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Hard bound at the socket: a bigger message disconnects its sender. Between
        # max_payload_bytes and this bound the client gets an error reply instead.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_payload_bytes + (64 << 10))
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tasks: dict[bytes, dict[str, asyncio.Task[None]]] = {}
        # Stream updates of the step being routed, per client: envelope -> (rids, frames).
        self._outbox: dict[tuple[bytes, ...], tuple[list[str], list[bytes]]] = {}
        manager.on_batch_end(self._flush)

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            await self._handle(frames[:-1], frames[-1])

    async def _handle(self, envelope: list[bytes], payload: bytes) -> None:
        rid: Any = None
        try:
            if len(payload) > self.max_payload_bytes:
                raise RequestError(f"message of {len(payload)} bytes exceeds the limit of "
                                   f"{self.max_payload_bytes} bytes", kind="payload_too_large")
            try:
                d = unpack_map(payload, self.max_payload_bytes)
            except WireError as e:
                raise RequestError(str(e)) from None
            rid = d.get("rid")
            if self.api_key is not None:
                key = d.get("api_key")
                if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.api_key.encode()):
                    raise RequestError("invalid or missing api_key", kind="unauthorized")
            d = {k: v for k, v in d.items() if k != "api_key"}
            if d.get("abort") is not None:
                await self._abort(envelope, d)
            elif d.get("admin") is not None:
                self.manager.spawn(self._admin(envelope, d))
            else:
                req = parse_generate(d)
                rid = req.rid or self.manager.new_rid()
                if rid in self.manager.states:
                    raise RequestError(f"request id {rid!r} is already in use", param="rid")
                self.manager.admit_check()
                task = asyncio.get_running_loop().create_task(self._run(envelope, rid, req))
                self.tasks.setdefault(envelope[0], {})[rid] = task
                task.add_done_callback(lambda _t, ident=envelope[0], r=rid: self._forget(ident, r))
        except RequestError as e:
            self._try_send(envelope, error_reply(rid, e))

    async def _abort(self, envelope: list[bytes], d: dict[str, Any]) -> None:
        rid = check_rid(d.get("rid"))
        if rid is None or d.get("abort") is not True:
            raise RequestError("an abort is {\"rid\": <id>, \"abort\": true}")
        if not await self.manager.abort(rid):
            raise RequestError(f"no request with id {rid!r} is in flight", kind="not_found", param="rid")

    async def _admin(self, envelope: list[bytes], d: dict[str, Any]) -> None:
        command, rid = d.get("admin"), d.get("rid")
        try:
            if command not in ADMIN_COMMANDS:
                raise RequestError(f"admin must be one of {', '.join(ADMIN_COMMANDS)}", param="admin")
            reply = await self.manager.admin(command)
            self._try_send(envelope, {"rid": rid, "admin": command, "ok": reply.ok, "result": reply.result})
        except RequestError as e:
            self._try_send(envelope, error_reply(rid, e))

    async def _run(self, envelope: list[bytes], rid: str, req: Any) -> None:
        text_parts: list[str] = []
        ids: list[int] = []
        logprobs: list[Any] = []
        def stream(out: TextOut) -> None:
            entry = self._outbox.get(key)
            if entry is None:  # (setdefault would build the empty pair for every update)
                entry = self._outbox[key] = ([], [])
            rids, frames = entry
            rids.append(rid)
            frames.append(msgpack.packb(output_reply(rid, out, out.text, out.new_ids, out.logprobs),
                                        use_bin_type=True))

        key = tuple(envelope)
        try:
            # A stream's updates are gathered as the manager routes each step's batch
            # (on_output) and sent when it is done (_flush), not by this task: it wakes once,
            # for the last, which it sends itself (the batch before it has gone out by then).
            async for out in self.manager.generate(req, rid=rid, on_output=stream if req.stream else None):
                if req.stream:
                    self._send(envelope, output_reply(rid, out, out.text, out.new_ids, out.logprobs))
                    continue
                text_parts.append(out.text)
                ids.extend(out.new_ids)
                logprobs.extend(out.logprobs)
                if out.finished:
                    self._send(envelope, output_reply(rid, out, "".join(text_parts), ids, logprobs))
        except RequestError as e:
            self._try_send(envelope, error_reply(rid, e))
        except ClientGone as e:
            logger.warning("request %s aborted: %s", rid, e)

    def _flush(self) -> None:
        """Send the step's gathered stream updates, one multipart message per client; a
        client that cannot take it loses all of its requests in it."""
        outbox, self._outbox = self._outbox, {}
        for envelope, (rids, frames) in outbox.items():
            try:
                self._send_frames(list(envelope), frames)
            except Exception as e:  # noqa: BLE001 - each request's task raises it and aborts
                for rid in rids:
                    self.manager.fail(rid, e)

    def _send(self, envelope: list[bytes], reply: dict[str, Any]) -> None:
        self._send_frames(envelope, [msgpack.packb(reply, use_bin_type=True)])

    def _send_frames(self, envelope: list[bytes], frames: list[bytes]) -> None:
        # NOTE: an asyncio socket's send returns a future instead of raising; a NOBLOCK send
        # has resolved by the time it returns, so its result is where a failure shows. A
        # multipart message is taken whole or not at all.
        fut = self.sock.send_multipart(envelope + frames, flags=zmq.NOBLOCK)
        if not fut.done():  # queued behind an earlier blocking send: let it finish on its own
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return
        try:
            fut.result()
        except zmq.Again:
            raise ClientGone("the client is not reading its replies (send queue full)") from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise ClientGone("the client disconnected") from None
            raise

    def _try_send(self, envelope: list[bytes], reply: dict[str, Any]) -> None:
        try:
            self._send(envelope, reply)
        except ClientGone:
            pass

    def _forget(self, identity: bytes, rid: str) -> None:
        tasks = self.tasks.get(identity)
        if tasks is not None:
            tasks.pop(rid, None)
            if not tasks:
                del self.tasks[identity]

    async def settle(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the request tasks to send their last replies, then
        cancel those still running (their requests are aborted on the way)."""
        await finish_or_cancel([t for per_client in self.tasks.values() for t in per_client.values()], timeout)

    def close(self) -> None:
        self.sock.close(linger=0)
