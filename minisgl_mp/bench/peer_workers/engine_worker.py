"""One run of `bench peers`' measures on our engine, in a process of its own.

    python minisgl_mp/bench/peer_workers/engine_worker.py SPEC.json OUT.json

SPEC is what `bench peers` writes (see vllm_worker.py for its fields) plus "engine": keyword
arguments for `LLM` (dtype, quantization, ...). An option this engine does not know (an older
tree without --quantization, say) is reported as {"skipped": why}, with exit status 0, so one
variant cannot sink the others.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

from minisgl_mp.bench import decode_floor
from minisgl_mp.bench.runs import EngineRunner, run_workload
from minisgl_mp.bench.workloads import Conversation, Turn, Workload
from minisgl_mp.llm import LLM


def save(result: dict[str, Any], path: str) -> None:
    """After each measure, so a run stopped by the timeout still reports what it measured."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


def build(spec: dict[str, Any]) -> LLM:
    per_decode = spec["decode_context"] + spec["warmup_steps"] + spec["decode_steps"] + 8
    per_fixed = max(len(p) for p in spec["requests"]) + spec["output_len"] + 8
    tokens = max(max(spec["decode_batch_sizes"], default=1) * per_decode, len(spec["requests"]) * per_fixed,
                 sum(len(p) + 8 for p in spec["prefill_requests"]))
    page = 16
    kwargs = {"load_format": "auto", "device": "cpu", "seed": spec["seed"], "num_threads": spec["threads"],
              "max_running_requests": max(spec["max_num_seqs"], len(spec["requests"])), "page_size": page,
              "num_pages": -(-tokens // page) + 8, "cpu_prefault_kv": True, **spec["engine"]}
    return LLM(spec["model"], **kwargs)


def main() -> int:
    spec = json.load(open(sys.argv[1], encoding="utf-8"))
    out_path = sys.argv[2]
    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    try:
        llm = build(spec)
    except (TypeError, ValueError) as e:  # an option this tree's EngineConfig rejects
        save({"skipped": f"the engine rejected {spec['engine']}: {type(e).__name__}: {e}"}, out_path)
        return 0
    result: dict[str, Any] = {"engine_kwargs": spec["engine"], "startup_s": time.perf_counter() - start,
                              "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    runner = EngineRunner(llm, progress=False)
    runner.warmup(spec["token_range"])
    measures = spec["measures"]
    if "fixed" in measures:
        workload = Workload("fixed", tuple(Conversation((Turn(tuple(p), spec["output_len"]),), group=i)
                                           for i, p in enumerate(spec["requests"])))
        r = run_workload("engine", workload, runner.generate, extra=runner.stats_delta)
        result["fixed"] = {"seconds": r.seconds, "output_tokens": r.output_tokens, "input_tokens": r.input_tokens,
                           "output_tps": r.output_tps, "engine_stats": r.extra}
        llm.scheduler.flush_cache()
        save(result, out_path)
    if "prefill" in measures:
        ids = spec["prefill_requests"]
        begin = time.perf_counter()
        runner.generate(ids, [1] * len(ids))
        seconds = time.perf_counter() - begin
        tokens = sum(len(p) for p in ids)
        result["prefill"] = {"seconds": seconds, "tokens": tokens, "tps": tokens / seconds}
        llm.scheduler.flush_cache()
        save(result, out_path)
    if "decode" in measures:
        result["decode"] = []
        for b in spec["decode_batch_sizes"]:
            t = decode_floor.engine_decode_steps(llm, b, spec["decode_context"], spec["decode_steps"],
                                                 spec["warmup_steps"], spec["token_range"], spec["seed"], False)
            result["decode"].append({"batch": b, "step_ms": 1e3 * statistics.median(t),
                                     "mean_ms": 1e3 * statistics.fmean(t), "steps": len(t)})
            save(result, out_path)
    save(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
