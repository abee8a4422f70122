"""Serving a parsed OpenAI request: the whole response, or its SSE stream.

Stream contract: `data: {...}` chunks ending in `data: [DONE]`; chat choices open with a chunk
whose delta carries the role; each choice has exactly one chunk with a finish_reason (it also
carries `matched_stop`); with include_usage, a last chunk with `choices: []` carries the usage.
An error after the stream began is sent as `data: {"error": {...}}`, then `[DONE]`.

Usage counts each prompt's tokens once, however many samples it has (as OpenAI does);
completion tokens add up over all choices; a prompt's cached tokens are the fewest any of its
samples found in the cache (the samples run concurrently and may hit one another's pages).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from minisgl_mp.message.messages import LogprobEntry, TextOut
from minisgl_mp.server.chat_output import ChatOutput
from minisgl_mp.server.fanout import Choice, ChoiceResult, run_choices
from minisgl_mp.server.http_io import SSE_DONE, error_body, json_logprob, sse
from minisgl_mp.server.openai_protocol import OpenAIRequest
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import RequestError


class TokenTexts:
    """Token id -> its text, for logprobs (cached: the same ids come back over and over)."""

    MAX_CACHED = 1 << 16

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < self.MAX_CACHED:
                self._cache[token_id] = text
        return text


def usage(req: OpenAIRequest, results: dict[int, ChoiceResult]) -> dict[str, Any]:
    """Usage so far (the final usage once every choice has finished)."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for c in req.choices:
        last = results[c.index].last
        if last is None:
            prompt[c.prompt_index] = len(c.ids)
            continue
        if not req.prompt_only:
            completion += last.completion_tokens
        prompt[c.prompt_index] = last.prompt_tokens
        cached[c.prompt_index] = min(cached.get(c.prompt_index, last.cached_tokens), last.cached_tokens)
    total_prompt = sum(prompt.values())
    out = {"prompt_tokens": total_prompt, "completion_tokens": completion, "total_tokens": total_prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    lasts = [results[c.index].last for c in req.choices]
    verify_ct = sum(last.spec_verify_ct for last in lasts if last is not None)
    if verify_ct:  # speculative decoding: tokens per verification step over the choices
        out["spec_verify_ct"] = verify_ct
        out["spec_accept_length"] = 1 + sum(last.spec_accepted_tokens for last in lasts if last is not None) / verify_ct
    return out


def _completion_logprobs(texts: TokenTexts, ids: list[int], entries: list[LogprobEntry], offset: int,
                         prompt_ids: Sequence[int] = (), prompt_entries: Sequence[LogprobEntry] = ()
                         ) -> tuple[dict[str, Any], int]:
    """OpenAI's completions logprobs for `ids`, after the echoed `prompt_ids` (whose first
    token has no log-probability: null, as OpenAI and vLLM); returns it and the text offset
    after it."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pairs: list[tuple[int, LogprobEntry | None]] = []
    if prompt_ids:
        pairs += zip(prompt_ids, [None, *prompt_entries])
    pairs += zip(ids, entries)
    for token, entry in pairs:
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else json_logprob(entry.logprob))
        out["top_logprobs"].append(None if entry is None else {
            texts(t): json_logprob(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)})
    return out, offset


def _chat_logprobs(texts: TokenTexts, ids: list[int], entries: list[LogprobEntry]) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = texts(token)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, e.logprob),
                         "top_logprobs": [item(i, lp) for i, lp in zip(e.top_ids, e.top_logprobs)]}
                        for t, e in zip(ids, entries)]}


def _finish(out: TextOut, parsed: ChatOutput | None = None) -> dict[str, Any]:
    if not out.finished:
        return {"finish_reason": None}
    reason = out.finish_reason if parsed is None else parsed.finish_reason(out.finish_reason)
    # A stop that ended a tool call is not a stop the client asked for (SGLang drops it too).
    return {"finish_reason": reason, "matched_stop": None if reason == "tool_calls" else out.matched_stop}


def _head(req: OpenAIRequest, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": req.model}


async def _collect(req: OpenAIRequest, manager: TokenizerManager) -> dict[int, ChoiceResult]:
    results = {c.index: ChoiceResult() for c in req.choices}
    async with contextlib.aclosing(run_choices(manager, req.choices)) as outs:
        async for index, out in outs:
            results[index].add(out)
    return results


async def complete(req: OpenAIRequest, manager: TokenizerManager, texts: TokenTexts) -> dict[str, Any]:
    """The whole (non-stream) response. Raises RequestError."""
    results = await _collect(req, manager)
    choices = []
    for c in req.choices:
        r = results[c.index]
        if r.last is None:  # run_choices ends only when every choice has finished
            raise RequestError(f"choice {c.index} ended without an output", kind="internal")
        if req.prompt_only:
            r.text, r.ids, r.logprobs = [], [], []
        text = c.echo + "".join(r.text)
        choice: dict[str, Any] = {"index": c.index}
        parsed = ChatOutput(req.output) if req.chat and req.output.active else None
        if req.chat:
            choice["message"] = {"role": "assistant", "content": text} if parsed is None else parsed.message(text)
            choice["logprobs"] = _chat_logprobs(texts, r.ids, r.logprobs) if req.logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = (_completion_logprobs(texts, r.ids, r.logprobs, 0, c.ids if c.echo else [],
                                                       r.prompt_logprobs)[0] if req.logprobs else None)
        choices.append({**choice, **_finish(r.last, parsed)})
    return {**_head(req, chunk=False), "choices": choices, "usage": usage(req, results)}


class _StreamState:
    """Per-choice progress of a stream: whether the echo went out, the text offset, and the
    chat parsers' state."""

    def __init__(self, req: OpenAIRequest, choice: Choice) -> None:
        self.choice = choice
        self.echo_pending = bool(choice.echo)
        self.offset = 0
        self.parsed = ChatOutput(req.output) if req.chat and req.output.active else None


def _chunk_choice(req: OpenAIRequest, st: _StreamState, out: TextOut, texts: TokenTexts) -> dict[str, Any] | None:
    """One choice's part of a stream chunk, or None when `out` brings nothing to send."""
    if req.prompt_only:
        out = dataclasses.replace(out, text="", new_ids=[], logprobs=[])
    if not (out.text or out.logprobs or out.finished or st.echo_pending):
        return None
    c = st.choice
    if req.chat:
        logprobs = _chat_logprobs(texts, out.new_ids, out.logprobs) if req.logprobs else None
        if st.parsed is None:
            return {"index": c.index, "delta": {"content": out.text}, "logprobs": logprobs, **_finish(out)}
        delta = st.parsed.feed(out.text)
        if out.finished:
            rest = st.parsed.finish()
            delta.reasoning += rest.reasoning
            delta.content += rest.content
            delta.tool_calls = (delta.tool_calls or []) + (rest.tool_calls or []) or None
        if not (delta.as_dict() or out.logprobs or out.finished):
            return None  # all of it held back (a tag may be starting)
        return {"index": c.index, "delta": delta.as_dict(), "logprobs": logprobs, **_finish(out, st.parsed)}
    text, logprobs = out.text, None
    prompt_ids = c.ids if st.echo_pending else []
    if st.echo_pending:
        text, st.echo_pending = c.echo + text, False
    if req.logprobs:
        logprobs, st.offset = _completion_logprobs(texts, out.new_ids, out.logprobs, st.offset, prompt_ids,
                                                   out.prompt_logprobs or ())
    return {"index": c.index, "text": text, "logprobs": logprobs, **_finish(out)}


async def stream(req: OpenAIRequest, manager: TokenizerManager, texts: TokenTexts) -> AsyncIterator[bytes]:
    head = _head(req, chunk=True)
    extra: dict[str, Any] = {"usage": None} if req.include_usage else {}
    results = {c.index: ChoiceResult() for c in req.choices}
    states = {c.index: _StreamState(req, c) for c in req.choices}
    if req.continuous_usage:
        extra = {"usage": usage(req, results)}
    try:
        if req.chat:
            for c in req.choices:
                yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], **extra})
        async with contextlib.aclosing(run_choices(manager, req.choices)) as outs:
            async for index, out in outs:
                results[index].add(out)
                part = _chunk_choice(req, states[index], out, texts)
                if part is not None:
                    if req.continuous_usage:  # vLLM's stream_options.continuous_usage_stats
                        extra = {"usage": usage(req, results)}
                    yield sse({**head, "choices": [part], **extra})
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage(req, results)})
    except RequestError as e:
        yield sse(error_body(e))
    yield SSE_DONE
