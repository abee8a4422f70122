"""One serving run: requests sent at Poisson arrivals (or all at once) under an optional
concurrency cap, each streamed to the end; then its latency and throughput summary."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from minisgl_mp.bench.report import summarize
from minisgl_mp.bench.serving_backends import Backend, RequestRecord


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: Poisson at `rate` req/s (first at 0), all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [0.0] + [float(x) for x in np.cumsum(gaps[:-1])]


async def run_requests(backend: Backend, requests: list[tuple[list[int], int]], rate: float,
                       max_concurrency: int | None, seed: int, timeout_s: float,
                       progress: bool = True) -> tuple[list[RequestRecord], float]:
    """(one record per request, in order; seconds from the first send to the last reply)."""
    offsets = arrival_offsets(len(requests), rate, seed)
    records = [RequestRecord(len(p), n) for p, n in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", disable=not progress, leave=False)
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with limit if limit is not None else contextlib.nullcontext():
            prompt, n = requests[i]
            try:
                await asyncio.wait_for(backend.send(prompt, n, records[i]), timeout_s)
            except asyncio.TimeoutError:
                records[i].error = f"no complete reply within {timeout_s:g}s"
            except Exception as e:  # a failed request is counted, not fatal to the run
                records[i].error = f"{type(e).__name__}: {e}"
        bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        bar.close()
    return records, time.perf_counter() - start


def summarize_run(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    in_tok, out_tok = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    short = sum(1 for r in ok if r.output_tokens != r.expected_output)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            msg = r.error or "ended without output"
            errors[msg[:200]] = errors.get(msg[:200], 0) + 1
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "input_tokens": in_tok, "output_tokens": out_tok,
        "outputs_of_wrong_length": short,
        "request_throughput": len(ok) / duration, "input_tps": in_tok / duration,
        "output_tps": out_tok / duration, "total_tps": (in_tok + out_tok) / duration,
        "mean_concurrency": sum(r.e2e for r in ok) / duration,
        "ttft_ms": summarize([r.ttft for r in ok], 1e3),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None], 1e3),
        "itl_ms": summarize([g for r in ok for g in r.itls], 1e3),
        "e2e_ms": summarize([r.e2e for r in ok], 1e3),
        "chunks_per_output_token": sum(len(r.chunk_times) for r in ok) / out_tok if out_tok else None,
        "errors": errors,
    }


def samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Raw latencies in ms, for the plots and the JSON."""
    ok = [r for r in records if r.ok]
    return {"ttft_ms": [r.ttft * 1e3 for r in ok], "e2e_ms": [r.e2e * 1e3 for r in ok],
            "tpot_ms": [t * 1e3 for r in ok if (t := r.tpot) is not None],
            "itl_ms": [g * 1e3 for r in ok for g in r.itls]}
