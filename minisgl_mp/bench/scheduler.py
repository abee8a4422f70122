"""What the scheduler itself costs a step: batch 64 decoding, with and without a long queue.

    python -m minisgl_mp.bench scheduler                              # generated model, 0 and 1,000 waiting
    python -m minisgl_mp.bench scheduler --model Qwen3-0.6B --steps 10

The engine runs in-process (as `bench offline`). `--batch` requests are admitted and brought to
decoding; `--waiting` more are queued behind them, which the running limit (`--batch`) keeps out.
Then `--steps` decode steps are timed, and each step split into its phases by timing the
scheduler's own methods: scheduling (choosing the batch, KV slots, page table, input tensors),
the model forward, sampling, and processing the results (appending tokens, stop checks, the
outputs). The scheduler's share is scheduling plus processing over the whole step. The same is
measured with an empty queue in the same run: the ratio says whether a waiting request costs a
running one anything. The generated model is the default because its forward is short, so the
scheduler's share is as large as it gets.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from minisgl_mp.bench.checkpoints import prepare_model
from minisgl_mp.bench.cli import bench_parser
from minisgl_mp.bench.report import machine_info, ratio, table, write_json
from minisgl_mp.llm import LLM
from minisgl_mp.sampling_params import SamplingParams

PHASES = ("schedule", "forward", "sample", "process")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("scheduler", __doc__)
    p.add_argument("--model", default="models/qwen3-tiny", help="folder or configs/models short name")
    p.add_argument("--load-format", choices=("auto", "dummy"), help="as bench offline")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"))
    p.add_argument("--batch", type=int, default=64, help="requests decoding (also the running limit)")
    p.add_argument("--waiting", default="0,1000", help="queue lengths to measure, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per queue length")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--schedule-policy", default="lpm", choices=("lpm", "fcfs"))
    p.add_argument("--num-threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/scheduler.json"))
    return p


class PhaseTimer:
    """Wraps methods of the scheduler (and its runner) so each call adds its time to a phase."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


def measure(llm: LLM, args: argparse.Namespace, waiting: int, rng: random.Random) -> dict[str, Any]:
    sched = llm.scheduler
    vocab = sched.runner.model_config.vocab_size
    max_tokens = args.warmup_steps + args.steps + 8
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rids = []
    for i in range(args.batch + waiting):
        rid = f"w{waiting}-{i}"
        sched.add_request(rid, [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
        rids.append(rid)
    # Bring the first `batch` to decoding (their prefills run in the first steps).
    while not (len(sched.running) == args.batch and all(r.is_decoding for r in sched.running)):
        sched.step()
    for _ in range(args.warmup_steps):
        sched.step()
    if len(sched.waiting) != waiting:
        raise RuntimeError(f"expected {waiting} waiting, found {len(sched.waiting)}")

    timer = PhaseTimer()
    for name, phase in (("_schedule", "schedule"), ("_sample", "sample"), ("_process", "process")):
        timer.wrap(sched, name, phase)
    timer.wrap(sched.runner, "forward", "forward")
    steps: list[dict[str, float]] = []
    for _ in range(args.steps):
        timer.current = {}
        t0 = time.perf_counter()
        sched.step()
        total = time.perf_counter() - t0
        steps.append({"total": total, **{p: timer.current.get(p, 0.0) for p in PHASES}})
    for name in ("_schedule", "_sample", "_process"):
        delattr(sched, name)
    delattr(sched.runner, "forward")
    if len(sched.running) != args.batch or len(sched.waiting) != waiting:
        raise RuntimeError("the batch changed while it was timed: raise --prompt-len or lower --steps")
    for rid in rids:
        sched.abort(rid)
    while sched.has_work:
        sched.step()
    sched.check_health(full=True)

    med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in ("total", *PHASES)}
    own = [(s["schedule"] + s["process"]) / s["total"] for s in steps]
    return {"waiting": waiting, "batch": args.batch, "steps": len(steps), "median_ms": med,
            "scheduler_share": statistics.median(own),
            "other_ms": med["total"] - sum(med[p] for p in PHASES)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    waits = [int(w) for w in args.waiting.split(",")]
    model = prepare_model(args.model, args.load_format, args.checkpoint_dir, args.seed)
    extra = {} if args.num_threads is None else {"num_threads": args.num_threads}
    llm = LLM(model.engine_model, load_format=model.engine_load_format, max_running_requests=args.batch,
              schedule_policy=args.schedule_policy, cpu_prefault_kv=True, seed=args.seed, **extra)
    rng = random.Random(args.seed)
    results = []
    for w in waits:
        print(f"batch {args.batch} decoding, {w} waiting: {args.steps} steps ...", flush=True)
        results.append(measure(llm, args, w, rng))
    rows = [[r["waiting"], *(f"{r['median_ms'][k]:.2f}" for k in ("total", *PHASES)), f"{r['other_ms']:.2f}",
             f"{100 * r['scheduler_share']:.1f}%"] for r in results]
    print(table(["waiting", "step ms", "schedule", "forward", "sample", "process", "other", "scheduler share"], rows))
    base = results[0]
    for r in results[1:]:
        print(f"{r['waiting']} waiting vs {base['waiting']}: step {ratio(r['median_ms']['total'], base['median_ms']['total']):.2f}x, "
              f"schedule {ratio(r['median_ms']['schedule'], base['median_ms']['schedule']):.2f}x")
    report = {"model": model.to_dict(), "policy": args.schedule_policy, "prompt_len": args.prompt_len,
              "results": results, "machine": machine_info()}
    print(f"wrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
