"""Offline throughput: the engine against Hugging Face transformers on the same requests.

    python -m minisgl_mp.bench offline --quick                # small shape, ~3 minutes on 2 cores
    python -m minisgl_mp.bench offline                        # Qwen3-0.6B shape, the issue's workload (long)
    python -m minisgl_mp.bench offline --workload shared-prefix --compare-naive --quick
    python -m minisgl_mp.bench offline --workload multi-turn --quick

The engine runs every request of the workload in one batch of work (one round per turn for
multi-turn); the baselines then run in the same process on the same requests: transformers
`generate` on static, left-padded batches (each batch runs to its longest output; only each
request's own output counts), and transformers' continuous batching. Both load the same
weights (see minisgl_mp/bench/checkpoints.py), in float32, greedy, ignoring EOS.
Baselines may be capped (--hf-max-requests) to fit in time: the ratios compare per-token
rates, which a smaller run of the same workload still measures (less batching helps neither).
The decode and prefill floors, with the same model and engine flags, are `bench floor`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from minisgl_mp.bench.checkpoints import BenchModel, prepare_model
from minisgl_mp.bench.cli import add_workload_args, bench_parser, int_list, token_range_of, workload_from_args
from minisgl_mp.bench.hf_baselines import HFContinuous, HFStatic, load_hf_model
from minisgl_mp.bench.report import machine_info, ratio, table, write_json
from minisgl_mp.bench.runs import run_engine, run_workload
from minisgl_mp.bench.workloads import Workload
from minisgl_mp.engine_config import DTYPE_CHOICES, QUANTIZATIONS, EngineConfig
from minisgl_mp.llm import LLM

FULL_MODEL, QUICK_MODEL = "Qwen3-0.6B", "qwen3-bench-small"
ENGINE_DEFAULTS = EngineConfig(model="-")


def add_model_args(p: argparse.ArgumentParser, out_help: str) -> None:
    """The flags `offline` and `floor` share: the run, the model and the engine."""
    p.add_argument("--quick", action="store_true", help=f"small run: the {QUICK_MODEL} shape "
                   "(configs/models), fewer requests and baseline batch sizes")
    p.add_argument("--seed", type=int, default=0, help="workload, dummy-weight and sampling seed")
    p.add_argument("--out", type=Path, help=out_help)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", help=f"folder or short name (default: {FULL_MODEL}, quick: {QUICK_MODEL})")
    m.add_argument("--load-format", choices=("auto", "dummy"),
                   help="default: the checkpoint when found locally, else dummy (a random checkpoint is written once)")
    m.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"),
                   help="where random checkpoints for dummy models are written")
    m.add_argument("--no-write-checkpoint", dest="write_checkpoint", action="store_false",
                   help="dummy models: engine dummy weights, baseline other random weights (same shape)")
    m.add_argument("--device", default="cpu", help="engine and baseline device (default: cpu)")
    m.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                   help="the engine's weights (default float32; the baselines keep float32)")
    m.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q],
                   help="the engine's weights stored as int8 or int4 (a GGUF file's own blocks where it has them)")
    m.add_argument("--cache-type", default=ENGINE_DEFAULTS.cache_type, choices=("radix", "naive"))
    m.add_argument("--max-running-requests", type=int, default=ENGINE_DEFAULTS.max_running_requests)
    m.add_argument("--max-prefill-tokens", type=int, default=ENGINE_DEFAULTS.max_prefill_tokens,
                   help="engine prefill chunk (default: the engine's, 2048 on CPU)")
    m.add_argument("--page-size", type=int, default=ENGINE_DEFAULTS.page_size)
    m.add_argument("--kv-cache-dtype", default=ENGINE_DEFAULTS.kv_cache_dtype, choices=DTYPE_CHOICES,
                   help="engine KV cache dtype (auto: the model's, float32 here)")
    m.add_argument("--num-pages", type=int, help="KV pool pages (default: the engine's sizing)")
    m.add_argument("--kv-cache-gb", type=float, help="KV pool size in GiB (default: the engine's)")
    m.add_argument("--schedule-policy", default=ENGINE_DEFAULTS.schedule_policy, choices=("fcfs", "lpm"))
    m.add_argument("--num-threads", type=int, help="torch CPU threads (default: torch's)")
    m.add_argument("--prefault-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="touch the whole KV pool before timing (the engine's --cpu-prefault-kv)")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("offline", __doc__)
    add_model_args(p, "JSON report (default: bench_results/offline_<workload>.json)")
    add_workload_args(p)
    h = p.add_argument_group("baselines")
    h.add_argument("--hf-batch-sizes", type=int_list, help="static batch sizes (default 1,8,32,64; quick 1,8,16)")
    h.add_argument("--hf-max-requests", type=int, help="run each baseline on the first max(N, batch size) "
                   "requests (conversations for multi-turn) (default 16; quick 4)")
    h.add_argument("--hf-cb", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' continuous batching (default: on)")
    h.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baselines")
    h.add_argument("--compare-naive", action="store_true", help="also run the engine with --cache-type naive")
    return p


def pick(value: Any, full: Any, quick: Any, args: argparse.Namespace) -> Any:
    return value if value is not None else (quick if args.quick else full)


def engine_kwargs(args: argparse.Namespace, model: BenchModel, cache_type: str) -> dict[str, Any]:
    return {"load_format": model.engine_load_format, "dtype": args.dtype, "device": args.device,
            "quantization": args.quantization,
            "seed": args.seed, "cache_type": cache_type, "max_running_requests": args.max_running_requests,
            "max_prefill_tokens": args.max_prefill_tokens, "page_size": args.page_size,
            "num_pages": args.num_pages, "kv_cache_gb": args.kv_cache_gb,
            "schedule_policy": args.schedule_policy, "num_threads": args.num_threads,
            "cpu_prefault_kv": args.prefault_kv, "kv_cache_dtype": args.kv_cache_dtype}


def run_baselines(args: argparse.Namespace, model: BenchModel, workload: Workload) -> dict[str, Any]:
    hf = load_hf_model(model, args.seed, args.device, args.progress)
    cap = pick(args.hf_max_requests, 16, 4, args)
    HFStatic(hf, 1, progress=False).generate([[1, 2, 3, 4]], [2])  # first-call costs, untimed
    static: list[dict[str, Any]] = []
    for bs in pick(args.hf_batch_sizes, [1, 8, 32, 64], [1, 8, 16], args):
        n = min(len(workload.conversations), max(cap, bs))
        runner = HFStatic(hf, bs, args.progress)
        print(f"transformers generate, static batches of {bs}: {n} conversations", flush=True)
        try:
            r = run_workload(f"hf static bs={bs}", workload.head(n), runner.generate)
            static.append({**r.to_dict(), "batch_size": bs, "conversations": n,
                           "generated_incl_padding": runner.generated_tokens})
        except Exception as e:  # one failing batch size must not lose the others
            static.append({"system": f"hf static bs={bs}", "batch_size": bs, "error": f"{type(e).__name__}: {e}"})
    out: dict[str, Any] = {"hf_static": static, "hf_cap_conversations": cap}
    if args.hf_cb:
        n = min(len(workload.conversations), cap)
        cb = HFContinuous(hf, args.max_prefill_tokens or ENGINE_DEFAULTS.prefill_chunk(args.device.split(":")[0]),
                          args.max_running_requests, progress=args.progress)
        print(f"transformers continuous batching: {n} conversations", flush=True)
        try:
            out["hf_cb"] = {**run_workload("hf continuous", workload.head(n), cb.generate).to_dict(),
                            "conversations": n, "cb_config": cb.config}
        except Exception as e:  # it may not run on this build or device: say why, keep the rest
            out["hf_cb"] = {"system": "hf continuous", "error": f"{type(e).__name__}: {e}", "cb_config": cb.config}
    return out


def throughput(args: argparse.Namespace, model: BenchModel) -> dict[str, Any]:
    llm = LLM(model.engine_model, **engine_kwargs(args, model, args.cache_type))
    token_range = token_range_of(llm.tokenizer, llm.scheduler.runner.model_config.vocab_size)
    workload = workload_from_args(args, token_range)
    print(f"{workload.name}: {workload.num_requests} requests in {workload.num_rounds} round(s)", flush=True)
    results = {"engine": run_engine(llm, workload, token_range, progress=args.progress).to_dict()}
    del llm
    if args.compare_naive and args.cache_type != "naive":
        llm = LLM(model.engine_model, **engine_kwargs(args, model, "naive"))
        results["engine_naive"] = run_engine(llm, workload, token_range, "engine naive", args.progress).to_dict()
        del llm
    gc.collect()
    if args.hf:
        results |= run_baselines(args, model, workload)
    return {"workload": {"name": workload.name, **workload.params, "requests": workload.num_requests,
                         "rounds": workload.num_rounds, "token_range": token_range},
            "results": results, "ratios": ratios(results)}


def ratios(res: dict[str, Any]) -> dict[str, float | None]:
    eng = res["engine"]
    ok_static = [r for r in res.get("hf_static", []) if "error" not in r]
    best = max(ok_static, key=lambda r: r["output_tps"], default=None)
    cb = res.get("hf_cb") if res.get("hf_cb") and "error" not in res["hf_cb"] else None
    out = {"best_hf_static": best["system"] if best else None,
           "engine_over_best_static_output_tps": ratio(eng["output_tps"], best and best["output_tps"]),
           "engine_over_best_static_total_tps": ratio(eng["total_tps"], best and best["total_tps"]),
           "engine_over_hf_cb_output_tps": ratio(eng["output_tps"], cb and cb["output_tps"]),
           "engine_over_hf_cb_total_tps": ratio(eng["total_tps"], cb and cb["total_tps"])}
    naive = res.get("engine_naive")
    if naive:
        out["radix_over_naive_output_tps"] = ratio(eng["output_tps"], naive["output_tps"])
        out["radix_over_naive_total_tps"] = ratio(eng["total_tps"], naive["total_tps"])
        out["naive_over_radix_prefill_tokens"] = ratio(naive["engine_stats"]["prefill_tokens"],
                                                       eng["engine_stats"]["prefill_tokens"])
    return out


def print_throughput(report: dict[str, Any]) -> None:
    res = report["results"]
    runs = [res["engine"]] + ([res["engine_naive"]] if "engine_naive" in res else [])
    runs += res.get("hf_static", []) + ([res["hf_cb"]] if "hf_cb" in res else [])
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["system"], "failed: " + r["error"][:60]] + [None] * 8)
            continue
        st = r.get("engine_stats", {})
        rows.append([r["system"], r["requests"], r["seconds"], r["request_throughput"], r["input_tps"],
                     r["output_tps"], r["total_tps"], st.get("prefill_tokens"), st.get("cached_prompt_tokens"),
                     ratio(res["engine"]["output_tps"], r["output_tps"])])
    print(table(["system", "requests", "seconds", "req/s", "in tok/s", "out tok/s", "total tok/s",
                 "prefill computed", "cached", "engine/this out"], rows))
    for k, v in report["ratios"].items():
        print(f"  {k}: {v:.2f}" if isinstance(v, float) else f"  {k}: {v}")


def write_report(args: argparse.Namespace, argv: list[str] | None, name: str, model: BenchModel, mode: str,
                 body: dict[str, Any], start: float) -> Path:
    """The report `offline` and `floor` write: the run, the model, the engine, the machine, the body."""
    report = {"mode": mode, "quick": args.quick, "argv": sys.argv[1:] if argv is None else argv,
              "model": {"name": name, **model.to_dict(), "quick_shape": args.quick and args.model is None},
              "engine": engine_kwargs(args, model, args.cache_type), "machine": machine_info(), **body,
              "notes": ["engine driven through Scheduler.step with token ids (no detokenizer, like HF generate)",
                        "baselines may run fewer requests (hf_cap_conversations); ratios compare per-token rates",
                        "hf static counts each request's own output tokens; generated_incl_padding is the work done"],
              "wall_seconds": time.perf_counter() - start}
    if args.quick and args.model is None:
        print(f"quick mode: the {QUICK_MODEL} shape (configs/models/{QUICK_MODEL}.json), not Qwen3-0.6B")
    if mode not in ("decode_floor", "prefill_floor"):
        print_throughput(report)
    out = write_json(args.out or Path(f"bench_results/offline_{mode}.json"), report)
    print(f"wrote {out} ({report['wall_seconds']:.0f}s)")
    return out


def run_tool(tool: str, args: argparse.Namespace, argv: list[str] | None, mode: str,
             body: Callable[[argparse.Namespace, BenchModel], dict[str, Any]]) -> int:
    """The run `offline` and `floor` share: threads, the model prepared, `body`'s figures
    written as `mode`'s report; a model or workload it cannot run exits 2 with the reason."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    name = pick(args.model, FULL_MODEL, QUICK_MODEL, args)
    start = time.perf_counter()
    try:
        model = prepare_model(name, args.load_format, args.checkpoint_dir, args.seed, args.write_checkpoint)
        print(f"model {name}: {model.note}", flush=True)
        figures = body(args, model)
    except ValueError as e:
        print(f"bench {tool}: {e}", file=sys.stderr)
        return 2
    write_report(args, argv, name, model, mode, figures, start)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool("offline", args, argv, args.workload.replace("-", "_"), throughput)

if __name__ == "__main__":
    sys.exit(main())
