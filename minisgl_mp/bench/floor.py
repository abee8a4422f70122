"""How close the engine gets to the machine: one decode step against its bare matrix products
and the machine's floors, or one long prefill against its FLOPs.

    python -m minisgl_mp.bench floor --batch-sizes 1,64 --context-len 256
    python -m minisgl_mp.bench floor --model Qwen3-0.6B --batch-sizes 1,64 --kv-cache-dtype bfloat16
    python -m minisgl_mp.bench floor --prefill-floor --prompt-len 2048

--decode-floor (the default) compares one engine decode step with its bare matrix products
and with the machine's bandwidth and FLOP/s floors (see minisgl_mp/bench/decode_floor.py).
--prefill-floor times one long prompt's prefill (one step) against its matrix-product FLOPs at
the matmul rate measured in the same run, and against the bare chain of its layer products.
The model and engine flags are `bench offline`'s; the report goes to
bench_results/offline_decode_floor.json (offline_prefill_floor.json) unless --out says.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from minisgl_mp.bench import decode_floor
from minisgl_mp.bench.checkpoints import BenchModel
from minisgl_mp.bench.cli import bench_parser, int_list, token_range_of
from minisgl_mp.bench.offline import add_model_args, engine_kwargs, pick, run_tool
from minisgl_mp.bench.report import table
from minisgl_mp.llm import LLM


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("floor", __doc__)
    add_model_args(p, "JSON report (default: bench_results/offline_decode_floor.json, or offline_prefill_floor.json)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--decode-floor", action="store_true",
                      help="measure decode step vs matmul chain and floors (the default)")
    mode.add_argument("--prefill-floor", action="store_true",
                      help="measure a long prefill vs its FLOPs at the matmul rate")
    f = p.add_argument_group("--decode-floor")
    f.add_argument("--batch-sizes", type=int_list, help="decoding requests per step (default 1,64; quick 1,16)")
    f.add_argument("--context-len", type=int, help="prompt tokens of each decoding request (default 256; quick 128)")
    f.add_argument("--decode-steps", type=int, help="timed steps per batch size (default 20; quick 8)")
    f.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps first")
    f.add_argument("--chain-reps", type=int, default=10, help="timed runs of each matmul chain")
    f.add_argument("--bandwidth-mib", type=int, default=512, help="tensor size for the bandwidth test")
    g = p.add_argument_group("--prefill-floor")
    g.add_argument("--prompt-len", type=int, help="prompt tokens (default 2048; quick 512)")
    g.add_argument("--prefill-reps", type=int, default=3, help="timed prefills (after one untimed)")
    return p


def floor_report(args: argparse.Namespace, model: BenchModel) -> dict[str, Any]:
    sizes = pick(args.batch_sizes, [1, 64], [1, 16], args)
    context, steps = pick(args.context_len, 256, 128, args), pick(args.decode_steps, 20, 8, args)
    per_req = context + args.warmup_steps + steps + 8
    kw = engine_kwargs(args, model, args.cache_type)
    kw |= {"max_running_requests": max(sizes), "num_pages": args.num_pages or -(-max(sizes) * per_req // args.page_size)}
    llm = LLM(model.engine_model, **kw)
    token_range = token_range_of(llm.tokenizer, llm.scheduler.runner.model_config.vocab_size)
    print("measuring memory bandwidth and matmul FLOP/s", flush=True)
    bw, mm = decode_floor.measure_bandwidth(args.bandwidth_mib), decode_floor.measure_matmul()
    rows = decode_floor.measure(llm, sizes, context, steps, args.warmup_steps, args.chain_reps, token_range,
                                args.seed, bw, mm, args.progress)
    print(f"read bandwidth {bw['read_gbps']:.1f} GB/s, copy {bw['copy_gbps']:.1f} GB/s, "
          f"matmul {mm['gflops']:.1f} GFLOP/s")
    print(table(["batch", "step ms", "chain(engine Linear) ms", "chain(F.linear) ms", "chain(oneDNN) ms", "floor bw ms",
                 "floor flops ms", "step/chain", "step/chain F", "step/floor"],
                [[r["batch"], r["step_ms"]["median"], r["chain_engine_linear_ms"],
                  "-" if r["chain_f_linear_ms"] is None else r["chain_f_linear_ms"],
                  "-" if r["chain_onednn_ms"] is None else r["chain_onednn_ms"],
                  r["floor_bandwidth_ms"], r["floor_flops_ms"], r["ratios"]["step_over_chain_engine_linear"],
                  r["ratios"]["step_over_chain_f_linear"] or "-", r["ratios"]["step_over_floor"]] for r in rows]))
    return {"decode_floor": {"context_len": context, "decode_steps": steps, "warmup_steps": args.warmup_steps,
                             "engine_overrides": {k: kw[k] for k in ("max_running_requests", "num_pages")},
                             "bandwidth": bw, "matmul": mm, "rows": rows}}


def prefill_report(args: argparse.Namespace, model: BenchModel) -> dict[str, Any]:
    prompt_len = pick(args.prompt_len, 2048, 512, args)
    kw = engine_kwargs(args, model, args.cache_type)
    kw |= {"max_prefill_tokens": max(prompt_len, args.max_prefill_tokens or 0), "max_running_requests": 1,
           "num_pages": args.num_pages or -(-(prompt_len + 8) // args.page_size)}
    llm = LLM(model.engine_model, **kw)
    token_range = token_range_of(llm.tokenizer, llm.scheduler.runner.model_config.vocab_size)
    print("measuring matmul FLOP/s", flush=True)
    mm = decode_floor.measure_matmul()
    row = decode_floor.measure_prefill(llm, prompt_len, args.prefill_reps, token_range, args.seed, mm)
    peak = mm["fma_peak_gflops"]
    print(f"matmul {mm['gflops']:.1f} GFLOP/s"
          + (f"; FMA ceiling {peak:.1f} GFLOP/s: the matmul at {mm['matmul_share_of_peak']:.0%} of it, the layer "
             f"products at {row['layer_products_share_of_fma_peak']:.0%}" if peak else ""))
    print(table(["prompt", "prefill ms", "tok/s", "GFLOP/s", "floor ms", "layer products ms", "prefill/floor",
                 "attention share"],
                [[prompt_len, row["prefill_ms"]["median"], row["prefill_tps"], row["gflops_achieved"],
                  row["floor_flops_ms"], row["chain_layer_products_ms"], row["ratios"]["prefill_over_floor_flops"],
                  row["attention_share_of_flops"]]]))
    return {"prefill_floor": {"engine_overrides": {k: kw[k] for k in ("max_prefill_tokens", "num_pages")},
                              "matmul": mm, **row}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prefill_floor:
        return run_tool("floor", args, argv, "prefill_floor", prefill_report)
    return run_tool("floor", args, argv, "decode_floor", floor_report)

if __name__ == "__main__":
    sys.exit(main())
