"""Prefill with the float32 products on the panels (csrc/packed_gemm.c's packed-x path, the
engine's default) against the same prefill with oneDNN's prepacked copy running the batches
past 256 rows (`--cpu-prepack`, the default before docs/benchmarks.md section 25), in one
process, the two taking turns on fresh prompts of the same lengths.

    python launch/bench_prefill_products.py --out bench_results/prefill_products.json
    python launch/bench_prefill_products.py --prompts 1 --prompt-len 2048 --rounds 4

One engine holds both copies (built with cpu_prepack=True); a round times one prefill each
way, the order alternating, switching the path through `Linear.PANELS_MAX_ROWS` (the row count
up to which a Linear with both copies takes the panels). Reports each round's prompt tok/s and
panels / oneDNN time per pair (below 1: the panels are faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from minisgl_mp.bench.checkpoints import prepare_model
from minisgl_mp.bench.report import machine_info, table, write_json
from minisgl_mp.bench.runs import EngineRunner
from minisgl_mp.layers.linear import Linear
from minisgl_mp.llm import LLM

PATHS = {"oneDNN": Linear.PANELS_MAX_ROWS, "panels": 1 << 62}  # PANELS_MAX_ROWS for each path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B", help="folder or configs/models short name (default: Qwen3-0.6B)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=8, help="prompts prefilled together (one chunk at 8 x 256)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6, help="panels / oneDNN pairs, order alternating")
    p.add_argument("--out", type=Path, default=Path("bench_results/prefill_products.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    model = prepare_model(args.model, None, args.checkpoint_dir, args.seed)
    tokens = args.prompts * (args.prompt_len + 8)
    llm = LLM(model.engine_model, load_format=model.engine_load_format, seed=args.seed, dtype="float32",
              num_pages=-(-tokens // 16) + 8, page_size=16, max_running_requests=max(args.prompts, 1),
              cpu_prefault_kv=True, cpu_prepack=True)
    linears = [m for m in llm.scheduler.runner.model.modules() if isinstance(m, Linear)]
    if not all(m.panels is not None and m.packed_weight is not None for m in linears):
        print("bench_prefill_products: this engine does not hold both copies (no C kernels, or not float32)",
              file=sys.stderr)
        return 2
    # Both paths through the modules: the C layer loop (engine/cpu_decode.py) takes only the
    # panels' steps, and would add its own saving to theirs.
    llm.scheduler.runner.model.layer_runner = None
    runner = EngineRunner(llm, progress=False)
    vocab = llm.scheduler.runner.model_config.vocab_size
    token_range = min(vocab, 1000)
    runner.warmup(token_range)
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    try:
        for r in range(args.rounds):
            for name in (tuple(PATHS) if r % 2 else tuple(reversed(PATHS))):
                Linear.PANELS_MAX_ROWS = PATHS[name]
                prompts = [[rng.randrange(token_range) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
                t = time.perf_counter()
                runner.generate(prompts, [1] * len(prompts))
                times[name].append(time.perf_counter() - t)
                llm.scheduler.flush_cache()
    finally:
        Linear.PANELS_MAX_ROWS = PATHS["oneDNN"]
        llm.shutdown()
    prompt_tokens = args.prompts * args.prompt_len
    pairs = [p / o for p, o in zip(times["panels"], times["oneDNN"])]
    print(table(["round", "panels tok/s", "oneDNN tok/s", "panels / oneDNN time"],
                [[r, f"{prompt_tokens / p:.1f}", f"{prompt_tokens / o:.1f}", f"{x:.3f}"]
                 for r, (p, o, x) in enumerate(zip(times["panels"], times["oneDNN"], pairs))]))
    print(f"median panels / oneDNN: {statistics.median(pairs):.3f}")
    result: dict[str, Any] = {"prompts": args.prompts, "prompt_len": args.prompt_len, "seconds": times,
                              "panels_over_onednn": pairs, "median_ratio": statistics.median(pairs)}
    out = write_json(args.out, {"argv": sys.argv[1:] if argv is None else argv, "model": model.to_dict(),
                                "machine": machine_info(), "results": result,
                                "wall_seconds": time.perf_counter() - start})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
