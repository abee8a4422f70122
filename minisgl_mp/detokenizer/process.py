"""The detokenizer process: token ids from the scheduler in, text deltas to the tokenizer out."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

from minisgl_mp.server_config import ServerConfig
from minisgl_mp.utils.process import StatusPipe, StopFlag, child_main

logger = logging.getLogger("minisgl_mp.detokenizer")
IDLE_POLL_MS = 100


class DetokenizerLoop:
    """Per-request decoding state lives from a request's first output to its last (finished or
    aborted); it is never evicted while the request lives."""

    def __init__(self, tokenizer: Any, inbox: Any, outbox: Any) -> None:
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.outbox = outbox
        self.states: dict[str, Any] = {}

    def run_once(self) -> bool:
        from minisgl_mp.message.messages import BatchTokenOut, ReqError, ShutdownReq

        msg = self.inbox.get(timeout_ms=IDLE_POLL_MS)
        if msg is None:
            return True
        if isinstance(msg, ShutdownReq):
            return False
        if isinstance(msg, BatchTokenOut):
            self.outbox.put(self._decode_batch(msg))
            return True
        if isinstance(msg, ReqError):
            self.states.pop(msg.rid, None)
        self.outbox.put(msg)  # errors and admin replies pass through, in order
        return True

    def _decode_batch(self, batch: Any) -> Any:
        from minisgl_mp.detokenizer.incremental import IncrementalDetokenizer, visible_ids
        from minisgl_mp.message.messages import BatchTextOut, TextOut

        outs = []
        for o in batch.outputs:
            state = self.states.get(o.rid)
            if state is None:
                d = o.detok
                state = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=d.skip_special_tokens if d else True,
                    stop=d.stop if d else (), min_tokens=d.min_tokens if d else 0,
                    prompt_ids=d.prompt_tail if d else (), include_stop=d.include_stop if d else False,
                )
                self.states[o.rid] = state
            text = state.push(visible_ids(o.new_ids, o.finished, o.matched_stop, state.include_stop))
            if o.finished:
                text += state.finish()
                del self.states[o.rid]
            outs.append(TextOut(
                rid=o.rid, text=text, new_ids=o.new_ids, finished=o.finished,
                finish_reason=o.finish_reason, matched_stop=o.matched_stop,
                prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
                cached_tokens=o.cached_tokens, logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs,
                spec_verify_ct=o.spec_verify_ct, spec_accepted_tokens=o.spec_accepted_tokens,
            ))
        return BatchTextOut(outs)


def _body(config: ServerConfig, status: StatusPipe, stop: StopFlag) -> None:
    from minisgl_mp.utils.no_torch import block_torch

    block_torch()
    import zmq

    from minisgl_mp.detokenizer.byte_table import byte_table
    from minisgl_mp.engine.tokenizer import load_tokenizer
    from minisgl_mp.message.messages import DETOKENIZER_CHANNEL, TOKENIZER_CHANNEL
    from minisgl_mp.message.transport import PullQueue, PushQueue

    tokenizer = load_tokenizer(config.model.tokenizer_dir)
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer found in {config.model.tokenizer_dir}")
    byte_table(tokenizer)  # built before the first request needs it
    ctx = zmq.Context()
    inbox = PullQueue(ctx, config.detokenizer_addr, DETOKENIZER_CHANNEL, bind=True)
    outbox = PushQueue(ctx, config.tokenizer_addr, TOKENIZER_CHANNEL)
    loop = DetokenizerLoop(tokenizer, inbox, outbox)
    status.ready()
    try:
        while not stop.is_set and loop.run_once():
            pass
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


def run_detokenizer_process(config: ServerConfig, conn: Connection) -> None:
    child_main("detokenizer", config.server.log_level, conn, lambda s, f: _body(config, s, f), drain_on_sigterm=False)
