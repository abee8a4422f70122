"""Steps with their layers in one C call (engine/cpu_decode.py) against the same steps through
the modules, in one process, the two taking turns on the same requests.

    python -m minisgl_mp.bench decode-plan --out bench_results/decode_plan.json
    python -m minisgl_mp.bench decode-plan --formats float16,int8 --batch-sizes 1 --rounds 5
    python -m minisgl_mp.bench decode-plan --model models/qwen3-tiny --formats float32 --batch-sizes 8,32 \
        --chunks 0,32,256

Per weight format, batch size and chunk: the median step (exactly B requests decoding at
`--context` cached tokens, and with a chunk C > 0 a fresh C-token prompt prefilled beside them
in every step, alone with B = 0: minisgl_mp/bench/decode_floor.engine_decode_steps) with the plan and without it,
each round's pair, and plan / modules per pair (below 1: the plan is faster). Both run the
same kernels and give the same logits (tests/test_cpu_decode_plan.py): the difference is what
the ~10 Python calls a layer cost around them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from minisgl_mp.bench.checkpoints import prepare_model
from minisgl_mp.bench.cli import bench_parser, count_list
from minisgl_mp.bench.decode_floor import engine_decode_steps
from minisgl_mp.bench.report import machine_info, table, write_json
from minisgl_mp.llm import LLM

FORMATS = {"float32": {}, "float16": {"dtype": "float16"}, "bfloat16": {"dtype": "bfloat16"},
           "int8": {"quantization": "int8"}}


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("decode-plan", __doc__)
    p.add_argument("--model", default="Qwen3-0.6B", help="folder or configs/models short name (default: Qwen3-0.6B)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", type=lambda s: [f for f in s.split(",") if f], default=["float32", "float16", "int8"])
    p.add_argument("--batch-sizes", type=count_list, default=[1, 4, 16],
                   help="requests decoding in each timed step (0: the chunk alone, a prefill-only step)")
    p.add_argument("--chunks", type=count_list, default=[0],
                   help="prompt tokens prefilled beside the decodes in each step (0: decode-only steps)")
    p.add_argument("--context", type=int, default=256, help="cached tokens of each decoding request")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="plan / modules pairs per batch size, order alternating")
    p.add_argument("--out", type=Path, default=Path("bench_results/decode_plan.json"))
    return p


def measure(llm: LLM, batch_sizes: list[int], chunks: list[int], context: int, steps: int, rounds: int,
            token_range: int) -> list[dict[str, Any]]:
    runner = llm.scheduler.runner
    plan = runner.cpu_decode
    rows = []
    for b in batch_sizes:
        for chunk in chunks:
            if not b and not chunk:
                continue  # no decodes and no prompt: no step
            times: dict[str, list[float]] = {"plan": [], "modules": []}
            for r in range(rounds):
                order = (("plan", plan), ("modules", None)) if r % 2 == 0 else (("modules", None), ("plan", plan))
                for name, layer_runner in order:
                    runner.model.layer_runner = layer_runner
                    t = engine_decode_steps(llm, b, context, steps, 2, token_range, r, progress=False, chunk=chunk)
                    times[name].append(1e3 * statistics.median(t))
            runner.model.layer_runner = plan
            pairs = [p / m for p, m in zip(times["plan"], times["modules"])]
            rows.append({"batch": b, "chunk": chunk, "plan_ms": times["plan"], "modules_ms": times["modules"],
                         "plan_over_modules": pairs, "median_ratio": statistics.median(pairs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not any(args.batch_sizes) and not any(args.chunks):
        print("bench decode-plan: a step of 0 decodes needs a chunk > 0 (--batch-sizes 0 with --chunks 0)",
              file=sys.stderr)
        return 2
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        print(f"bench decode-plan: unknown formats {bad}; choose from {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    model = prepare_model(args.model, None, args.checkpoint_dir, args.seed)
    tokens = max(args.batch_sizes) * (args.context + 2 * args.steps + 16) + max(args.chunks) * (args.steps + 4)
    results: dict[str, Any] = {}
    for fmt in args.formats:
        llm = LLM(model.engine_model, load_format=model.engine_load_format, seed=args.seed,
                  num_pages=-(-tokens // 16) + 8, page_size=16, **FORMATS[fmt])
        if llm.scheduler.runner.cpu_decode is None:
            results[fmt] = {"skipped": "this model's steps do not run through the plan"}
        else:
            token_range = min(llm.scheduler.runner.model_config.vocab_size, 1000)
            results[fmt] = {"rows": measure(llm, args.batch_sizes, args.chunks, args.context, args.steps, args.rounds,
                                            token_range)}
        llm.shutdown()
    print(table(["format", "batch", "chunk", "plan ms (rounds)", "modules ms (rounds)", "plan / modules (pairs)"],
                [[fmt, r["batch"], r["chunk"], " / ".join(f"{x:.1f}" for x in r["plan_ms"]),
                  " / ".join(f"{x:.1f}" for x in r["modules_ms"]), " ".join(f"{x:.2f}" for x in r["plan_over_modules"])]
                 for fmt, res in results.items() for r in res.get("rows", [])]))
    out = write_json(args.out, {"argv": sys.argv[1:] if argv is None else argv, "model": model.to_dict(),
                                "context": args.context, "steps": args.steps, "machine": machine_info(),
                                "results": results, "wall_seconds": time.perf_counter() - start})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
