"""POST /generate in SGLang's shape: {"text" | "input_ids" | "messages", "sampling_params",
"stream", "rid"} in, {"text", "output_ids", "meta_info"} out. The request is parsed by the same
`parse_generate` as the ZMQ endpoint's, so both accept and reject exactly the same requests.

meta_info.finish_reason is SGLang's object: {"type": "stop", "matched": <token id or string>},
{"type": "length", "length": <completion tokens>} or {"type": "abort"}; null until finished.
A stream sends the cumulative text and output_ids in every event, as SGLang does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from minisgl_mp.server.fanout import Choice, ChoiceResult, run_choices
from minisgl_mp.server.http_io import SSE_DONE, HttpError, error_body, json_logprob, sse
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import RequestError, parse_generate


async def parse_native(body: dict[str, Any], manager: TokenizerManager) -> Choice:
    req = parse_generate(body)
    rid = req.rid or manager.new_rid()
    if rid in manager.states:
        raise HttpError(f"request id {rid!r} is already in use", param="rid")
    manager.admit_check()
    ids = await manager.prompt_ids(req)
    return Choice(index=0, prompt_index=0, sample_index=0, request=req, ids=ids, rid=rid)


def _finish_reason(r: ChoiceResult) -> dict[str, Any] | None:
    out = r.last
    if out is None or not out.finished:
        return None
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": out.completion_tokens}
    return {"type": out.finish_reason}


def native_body(choice: Choice, r: ChoiceResult) -> dict[str, Any]:
    last = r.last
    meta: dict[str, Any] = {
        "id": choice.rid, "finish_reason": _finish_reason(r),
        "prompt_tokens": last.prompt_tokens if last else len(choice.ids),
        "completion_tokens": last.completion_tokens if last else 0,
        "cached_tokens": last.cached_tokens if last else 0,
    }
    if choice.request.params.logprobs is not None:
        # SGLang's layout: [logprob, token id, token text (not returned: null)].
        meta["output_token_logprobs"] = [[json_logprob(e.logprob), t, None] for t, e in zip(r.ids, r.logprobs)]
        meta["output_top_logprobs"] = [[[json_logprob(lp), i, None] for i, lp in zip(e.top_ids, e.top_logprobs)]
                                       for e in r.logprobs]
    return {"text": "".join(r.text), "output_ids": list(r.ids), "meta_info": meta}


async def generate_once(choice: Choice, manager: TokenizerManager) -> dict[str, Any]:
    result = ChoiceResult()
    async with contextlib.aclosing(run_choices(manager, [choice])) as outs:
        async for _, out in outs:
            result.add(out)
    return native_body(choice, result)


async def generate_stream(choice: Choice, manager: TokenizerManager) -> AsyncIterator[bytes]:
    result = ChoiceResult()
    try:
        async with contextlib.aclosing(run_choices(manager, [choice])) as outs:
            async for _, out in outs:
                result.add(out)
                if out.text or out.new_ids or out.finished:
                    yield sse(native_body(choice, result))
    except RequestError as e:
        yield sse(error_body(e))
    yield SSE_DONE
