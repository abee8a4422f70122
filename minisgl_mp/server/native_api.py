"""POST /generate in SGLang's shape, so SGLang's clients, lm-eval's `sglang-generate`,
`sglang.bench_serving --backend sglang` and sglang-router work unchanged.

In: `text` (a string or a list) or `input_ids` (ids or a list of id lists) or `messages` (ours),
`sampling_params` (one object or one per prompt; SGLang's names such as `max_new_tokens` or ours;
`n` samples each prompt n times), `rid`, `stream`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `require_reasoning`. Out: {"text", "output_ids",
"meta_info"} per prompt and sample, a list when the input was a list or n > 1 (prompt-major), with
SGLang's meta_info: id, finish_reason ({"type": "stop", "matched": ...}, {"type": "length",
"length": n}, {"type": "abort"}; null until finished), prompt_tokens, completion_tokens,
cached_tokens, e2e_latency, and with return_logprob [logprob, token id, text or null] lists.

As in SGLang: max_new_tokens defaults to 128 and is cut to what the context leaves; the stream
sends the cumulative text and output_ids in every event (with "index" when batched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from minisgl_mp.message.messages import LogprobEntry
from minisgl_mp.server.fanout import Choice, ChoiceResult, run_choices
from minisgl_mp.server.http_io import SSE_DONE, HttpError, error_body, json_logprob, sse
from minisgl_mp.tokenizer.fields import check_extra_fields
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import (GenerateRequest, RequestError, check_input_ids, check_messages,
                                           check_rid, check_template_kwargs, make_params)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
NATIVE_FIELDS = frozenset({"text", "input_ids", "messages", "sampling_params", "rid", "stream", "return_logprob",
                           "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                           "chat_template_kwargs", "require_reasoning"})


@dataclass(frozen=True)
class LogprobRequest:
    """SGLang's logprob options for one prompt: `start` is its logprob_start_len (resolved)."""

    start: int
    top: int
    with_text: bool


@dataclass(frozen=True)
class NativeRequest:
    choices: list[Choice]
    logprobs: dict[int, LogprobRequest]  # choice index -> its options (absent: none)
    batched: bool  # answer with a list
    stream: bool
    created: float


def _per_prompt(body: dict[str, Any], name: str, count: int, batched: bool) -> list[Any]:
    """A field given once for all prompts, or (batched) as a list with one value per prompt."""
    value = body.get(name)
    if batched and isinstance(value, list) and name != "input_ids":
        if len(value) != count:
            raise HttpError(f"{name} has {len(value)} entries for {count} prompts", param=name)
        return value
    return [value] * count


def _prompts(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
    given = [k for k in ("text", "input_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise HttpError("give exactly one of 'text', 'input_ids' and 'messages'")
    kind, value = given[0], body[given[0]]
    batched = isinstance(value, list) and bool(value) and (
        kind == "text" or (kind == "input_ids" and not isinstance(value[0], int))
        or (kind == "messages" and isinstance(value[0], list)))
    items = value if batched else [value]
    if not items:
        raise HttpError(f"{kind} must not be an empty list", param=kind)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError("stream must be true or false", param="stream")
    params = _per_prompt(body, "sampling_params", len(items), batched)
    rids = _per_prompt(body, "rid", len(items), batched)
    template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    # SGLang's place for it (ours, sampling_params.require_reasoning, works too): the prompt
    # opens a thinking, so its grammar waits for the thinking to end.
    reasoning = body.get("require_reasoning")
    if reasoning is not None and not isinstance(reasoning, bool):
        raise HttpError("require_reasoning must be true or false", param="require_reasoning")
    reqs = []
    for item, p, rid in zip(items, params, rids):
        if kind == "text" and not isinstance(item, str):
            raise HttpError("text must be a string or a list of strings", param="text")
        if reasoning and (p is None or isinstance(p, dict)):
            p = {**(p or {}), "require_reasoning": True}
        reqs.append(GenerateRequest(
            rid=check_rid(rid) if not batched or isinstance(body.get("rid"), list) else None,
            params=make_params({k: v for k, v in (p or {}).items() if k != "n"} if isinstance(p, dict) else p,
                               SGLANG_DEFAULT_MAX_NEW_TOKENS),
            stream=stream,
            text=item if kind == "text" else None,
            input_ids=check_input_ids(item) if kind == "input_ids" else None,
            messages=check_messages(item) if kind == "messages" else None,
            chat_template_kwargs=template_kwargs))
    return reqs, batched


def _n(params: Any) -> int:
    n = params.get("n", 1) if isinstance(params, dict) else 1
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise HttpError(f"n must be an integer >= 1, got {n!r}", param="n")
    return n


def _logprob_request(body: dict[str, Any], i: int, batched: bool, count: int, prompt_len: int) -> LogprobRequest | None:
    want, start, top = (_per_prompt(body, name, count, batched)[i]
                        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"))
    if not want:
        return None
    start = -1 if start is None else start
    top = 0 if top is None else top
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise HttpError(f"logprob_start_len must be -1 or an integer >= 0, got {start!r}", param="logprob_start_len")
    if start >= prompt_len:
        raise HttpError(f"logprob_start_len ({start}) must be less than the number of prompt tokens ({prompt_len})",
                        param="logprob_start_len")
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise HttpError(f"top_logprobs_num must be an integer >= 0, got {top!r}", param="top_logprobs_num")
    # -1: output tokens only; SGLang then reports the last prompt token (with no log-probability).
    return LogprobRequest(start=prompt_len - 1 if start == -1 else start, top=top,
                          with_text=bool(body.get("return_text_in_logprobs")))


async def parse_native(body: dict[str, Any], manager: TokenizerManager) -> NativeRequest:
    check_extra_fields(body, NATIVE_FIELDS)
    created = time.perf_counter()
    reqs, batched = _prompts(body)
    ns = [_n(p) for p in _per_prompt(body, "sampling_params", len(reqs), batched)]
    for req in reqs:
        if req.rid is not None and req.rid in manager.states:
            raise HttpError(f"request id {req.rid!r} is already in use", param="rid")
    manager.admit_check(sum(ns))
    choices: list[Choice] = []
    logprobs: dict[int, LogprobRequest] = {}
    for i, (req, n) in enumerate(zip(reqs, ns)):
        probe = dataclasses.replace(req.params, max_tokens=1, min_tokens=0)
        ids = await manager.prompt_ids(dataclasses.replace(req, params=probe))
        lp = _logprob_request(body, i, batched, len(reqs), len(ids))
        try:
            params = dataclasses.replace(
                req.params, max_tokens=min(req.params.max_tokens, manager.context_len - len(ids)),
                logprobs=lp.top if lp else None,
                # Ours counts the first scored token; SGLang's the first token listed (unscored).
                logprob_start_len=lp.start + 1 if lp else None)
        except ValueError as e:  # min_new_tokens over what the context leaves
            raise HttpError(str(e), param="sampling_params") from None
        for j in range(n):
            rid = req.rid if n == 1 else (f"{req.rid}-{j}" if req.rid else None)
            if rid is not None and rid in manager.states:
                raise HttpError(f"request id {rid!r} is already in use", param="rid")
            seed = params.seed
            p = params if j == 0 or seed is None else dataclasses.replace(params, seed=(seed + j) % 2**63)
            index = len(choices)
            choices.append(Choice(index=index, prompt_index=i, sample_index=j,
                                  request=dataclasses.replace(req, params=p), ids=ids,
                                  rid=rid or manager.new_rid()))
            if lp is not None:
                logprobs[index] = lp
    return NativeRequest(choices=choices, logprobs=logprobs, batched=batched or len(choices) > 1,
                         stream=reqs[0].stream, created=created)


def _finish_reason(r: ChoiceResult) -> dict[str, Any] | None:
    out = r.last
    if out is None or not out.finished:
        return None
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    return {"type": out.finish_reason}


class _Texts:
    def __init__(self, manager: TokenizerManager, wanted: bool) -> None:
        self.tokenizer, self.wanted = manager.tokenizer, wanted

    def __call__(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.wanted else None


def _triples(texts: _Texts, ids: list[int], entries: list[LogprobEntry | None]) -> list[list[Any]]:
    return [[None if e is None else json_logprob(e.logprob), t, texts(t)] for t, e in zip(ids, entries)]


def _tops(texts: _Texts, entries: list[LogprobEntry | None]) -> list[list[list[Any]] | None]:
    return [None if e is None else [[json_logprob(lp), i, texts(i)] for i, lp in zip(e.top_ids, e.top_logprobs)]
            for e in entries]


def _add_logprobs(meta: dict[str, Any], lp: LogprobRequest, choice: Choice, r: ChoiceResult,
                  manager: TokenizerManager) -> None:
    texts = _Texts(manager, lp.with_text)
    prompt_ids = choice.ids[lp.start:]
    prompt_entries: list[LogprobEntry | None] = [None, *r.prompt_logprobs] if r.last is not None else []
    out_entries: list[LogprobEntry | None] = list(r.logprobs)
    meta["input_token_logprobs"] = _triples(texts, prompt_ids, prompt_entries)
    meta["output_token_logprobs"] = _triples(texts, r.ids, out_entries)
    if lp.top:
        meta["input_top_logprobs"] = _tops(texts, prompt_entries)
        meta["output_top_logprobs"] = _tops(texts, out_entries)


def native_body(req: NativeRequest, choice: Choice, r: ChoiceResult, manager: TokenizerManager) -> dict[str, Any]:
    last = r.last
    meta: dict[str, Any] = {
        "id": choice.rid, "finish_reason": _finish_reason(r),
        "prompt_tokens": last.prompt_tokens if last else len(choice.ids),
        "completion_tokens": last.completion_tokens if last else 0,
        "cached_tokens": last.cached_tokens if last else 0,
        "e2e_latency": time.perf_counter() - req.created,
    }
    if manager.config.engine.speculative_algorithm is not None:  # SGLang's keys
        meta["spec_verify_ct"] = last.spec_verify_ct if last else 0
        meta["spec_accept_length"] = last.spec_accept_length if last else 0.0
    lp = req.logprobs.get(choice.index)
    if lp is not None:
        _add_logprobs(meta, lp, choice, r, manager)
    return {"text": "".join(r.text), "output_ids": list(r.ids), "meta_info": meta}


async def generate_once(req: NativeRequest, manager: TokenizerManager) -> dict[str, Any] | list[dict[str, Any]]:
    results = {c.index: ChoiceResult() for c in req.choices}
    async with contextlib.aclosing(run_choices(manager, req.choices)) as outs:
        async for index, out in outs:
            results[index].add(out)
    bodies = [native_body(req, c, results[c.index], manager) for c in req.choices]
    return bodies if req.batched else bodies[0]


async def generate_stream(req: NativeRequest, manager: TokenizerManager) -> AsyncIterator[bytes]:
    results = {c.index: ChoiceResult() for c in req.choices}
    try:
        async with contextlib.aclosing(run_choices(manager, req.choices)) as outs:
            async for index, out in outs:
                results[index].add(out)
                if out.text or out.new_ids or out.finished:
                    body = native_body(req, req.choices[index], results[index], manager)
                    yield sse({**body, "index": index} if req.batched else body)
    except RequestError as e:
        yield sse(error_body(e))
    yield SSE_DONE
