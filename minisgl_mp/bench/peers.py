"""The engine beside the engines a CPU user would pick instead: vLLM's CPU build and llama.cpp.

    make bench-peers                                   # installs the peers, then runs this
    python -m minisgl_mp.bench peers                       # Qwen3-0.6B shape, every system (long)
    python -m minisgl_mp.bench peers --systems engine,llama-f32 --decode-batch-sizes 1
    python -m minisgl_mp.bench peers --engine-variants float32,float16,int8 --gguf-types f32,f16,q8_0
    python -m minisgl_mp.bench peers --model models/SmolLM2-135M-Instruct --input-len 128 --output-len 64 \
        --engine-variants float32,int8,int4 --gguf-types f32,q8_0,q4_1 --variant-measures fixed,decode

One run, one checkpoint (by default a random Qwen3-0.6B-shaped one written by our make_model
tool, see minisgl_mp/bench/checkpoints.py; or a GGUF file such as the default model's, which
the engine and llama.cpp run as it is and vLLM from its float32 export), the same requests, float32 weights unless a variant
says otherwise, 2 threads each. Every system runs in a subprocess of its own, one after the
other, so none shares threads or caches with another. Per system:
- fixed: 32 requests x 256 prompt tokens x 64 output tokens submitted at once, output tok/s;
- prefill: 32 x 256-token prompts at once, prompt tok/s;
- decode: the median step with exactly B requests decoding at a 256-token context, ms.
How each is measured:
- engine (minisgl_mp/bench/peer_workers/engine_worker.py): Scheduler.step with token ids, as `bench offline`;
  decode steps timed one by one (minisgl_mp/bench/decode_floor.engine_decode_steps).
- vllm (peer_workers/vllm_worker.py, in .peers/vllm-venv): LLM.generate with token ids for
  fixed and prefill (prefix caching off); decode steps timed one by one through
  llm_engine.step() with the engine core in-process. Its start-up compile is not timed.
- llama-<type> (.peers/llama-build/bin/llama-batched-bench, the checkpoint converted with
  convert_hf_to_gguf.py): -npp 256 -ntg 64 -npl 32 for fixed (output tokens over prompt+decode
  time) and prefill (its S_PP: 32 x 256 prompts in one batch); -npp 256 -npl B for decode
  (T_TG / TG: the mean step, every sequence decoding). It draws random tokens, as our
  requests are random tokens; its KV cache stays at llama.cpp's default (f16).
Beside them, the machine's float32 FMA ceiling, measured before each system runs
(kernels/csrc/fma_peak.c): the fixed and prefill workloads' FLOPs over it are the time no
engine can beat, and each system's time is reported against that floor.
Variants (engine float16/bfloat16/int8 through --dtype/--quantization, vLLM bfloat16 through
--vllm-dtypes, llama f16/q8_0) run --variant-measures only (default: decode at --variant-batch-sizes, 1), to keep the run short.
An engine variant the engine rejects (an option it does not have yet) is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl_mp.bench import decode_floor, plots
from minisgl_mp.bench.checkpoints import prepare_model
from minisgl_mp.bench.cli import bench_parser, int_list
from minisgl_mp.bench.llama_cpp import REPO, WORKERS, llama_run, run_logged
from minisgl_mp.bench.report import fmt, machine_info, ratio, table, write_json
from minisgl_mp.bench.workloads import LengthRange, random_workload
from minisgl_mp.kernels import cpu as cpu_kernels

ENGINE_VARIANTS = {"float32": {"dtype": "float32"}, "float16": {"dtype": "float16"},
                   "bfloat16": {"dtype": "bfloat16"}, "int8": {"dtype": "float32", "quantization": "int8"},
                   "int4": {"dtype": "float32", "quantization": "int4"},
                   # bfloat16 weights widened to float32 on a CPU with AMX (docs/benchmarks.md s.22)
                   # or with AVX512-BF16's dot products (s.23): neither 16-bit path
                   "bfloat16-noamx": {"dtype": "bfloat16", "cpu_amx": False, "cpu_bf16_dot": False},
                   # bfloat16 weights and K/V, as vLLM's bfloat16 runs them (docs/benchmarks.md s.23)
                   "bfloat16-kv-bf16": {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
                   # glibc's malloc as it comes: large blocks unmapped on free (docs/benchmarks.md s.18)
                   "float32-malloc-default": {"dtype": "float32", "cpu_keep_freed_memory": False},
                   # oneDNN's prepacked copy for batches past 256 rows, the default before
                   # docs/benchmarks.md section 25 (the panels run them otherwise)
                   "float32-onednn": {"dtype": "float32", "cpu_prepack": True}}
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")  # q4_*: only the model's own GGUF file
VLLM_DTYPES = ("float32", "bfloat16")
# Variants whose arithmetic is not (only) float32: the float32 FMA ceiling is no floor for them.
NOT_FLOAT32 = ("float16", "bfloat16", "int8", "int4", "-f16", "-bf16", "-q8_0", "-q4_0", "-q4_1")
MEASURES = ("fixed", "prefill", "decode")
BASELINE = "engine"  # ratios are each system's figure over this one's


def csv(choices: tuple[str, ...] | dict[str, Any]):  # argparse type
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("peers", __doc__)
    p.add_argument("--model", default="Qwen3-0.6B", help="folder or configs/models short name (default: Qwen3-0.6B)")
    p.add_argument("--load-format", choices=("auto", "dummy"), help="as bench offline (default: a checkpoint if found, "
                   "else a random one written once)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="threads each system gets")
    p.add_argument("--systems", type=csv(("engine", "vllm", "llama")), default=["engine", "vllm", "llama"])
    p.add_argument("--engine-variants", type=csv(ENGINE_VARIANTS), default=["float32"],
                   help="engine weight formats: float32 (the baseline, always first), float16, bfloat16, int8; "
                        "float32-malloc-default (float32 with --no-cpu-keep-freed-memory), bfloat16-noamx "
                        "(bfloat16 widened: --no-cpu-amx --no-cpu-bf16-dot), bfloat16-kv-bf16 (bfloat16 weights and "
                        "KV cache)")
    p.add_argument("--vllm-dtypes", type=csv(VLLM_DTYPES), default=["float32"],
                   help="vLLM's dtypes: float32 (the float32 peer, always first), bfloat16 (vLLM's CPU default, "
                        "beside --engine-variants bfloat16)")
    p.add_argument("--gguf-types", type=csv(GGUF_TYPES), default=["f32", "f16", "q8_0"],
                   help="llama.cpp weight formats (f32 is the float32 peer)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--decode-batch-sizes", type=int_list, default=[1, 16, 64])
    p.add_argument("--decode-context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--decode-steps", type=int, default=10, help="timed steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--measures", type=csv(MEASURES), default=list(MEASURES), help="for the float32 systems")
    p.add_argument("--variant-measures", type=csv(MEASURES), default=["decode"],
                   help="for the other weight formats (default: decode only)")
    p.add_argument("--variant-batch-sizes", type=int_list, default=[1])
    p.add_argument("--vllm-kv-gib", type=int, default=6, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE); "
                   "6 holds 64 x 266 float32 tokens of Qwen3-0.6B")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without its compiled graph (a quick check "
                   "that it runs; not its speed)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each system may take")
    p.add_argument("--peers-dir", type=Path, default=Path(".peers"), help="where make bench-peers-setup put them")
    p.add_argument("--reuse", type=Path, help="an earlier report: its systems not run now are taken from it "
                   "(marked reused_from), e.g. to rerun the engine against a vLLM run without its compile")
    p.add_argument("--out", type=Path, default=Path("bench_results/peers.json"))
    p.add_argument("--plot", type=Path, default=Path("bench_results/peers.png"))
    return p


def token_range(model_dir: Path, vocab_size: int) -> int:
    """Prompt ids are drawn from the tokenizer's ordinary tokens, as bench offline's are."""
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.exists():
        return vocab_size
    from tokenizers import Tokenizer

    return min(Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=False), vocab_size)


def make_spec(args: argparse.Namespace, model_dir: Path, vocab_size: int) -> dict[str, Any]:
    tr = token_range(model_dir, vocab_size)
    length = LengthRange(args.input_len, args.input_len)
    out = LengthRange(args.output_len, args.output_len)
    fixed = random_workload(args.num_prompts, length, out, tr, args.seed).single_turn_requests()
    prefill = random_workload(args.num_prompts, length, LengthRange(1, 1), tr, args.seed + 1).single_turn_requests()
    return {"model": str(model_dir.resolve()), "threads": args.threads, "seed": args.seed, "token_range": tr,
            "requests": [p for p, _ in fixed], "output_len": args.output_len,
            "prefill_requests": [p for p, _ in prefill], "decode_context": args.decode_context,
            "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps,
            "max_num_seqs": max([args.num_prompts, *args.decode_batch_sizes]),
            "max_model_len": max(args.input_len + args.output_len,
                                 args.decode_context + args.warmup_steps + args.decode_steps + 8) + 64,
            "kv_cache_gib": args.vllm_kv_gib, "vllm_eager": args.vllm_eager}


def python_worker(name: str, python: str, script: str, spec: dict[str, Any], work: Path,
                  timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    out_path.unlink(missing_ok=True)
    start = time.perf_counter()
    rc, tail = run_logged([python, script, str(spec_path), str(out_path)], work / f"{name}.log", timeout, env)
    result = json.loads(out_path.read_text(encoding="utf-8")) if out_path.exists() else {}
    result["wall_s"] = time.perf_counter() - start
    if rc != 0:
        result["error"] = ("timed out" if rc is None else f"exit {rc}") + f"; log {work / (name + '.log')}: ...{tail[-600:]}"
    return result


def engine_run(variant: str, spec: dict[str, Any], measures: list[str], batches: list[int],
               work: Path, timeout: float) -> dict[str, Any]:
    s = {**spec, "model": spec.get("engine_model", spec["model"]), "engine": ENGINE_VARIANTS[variant],
         "measures": measures, "decode_batch_sizes": batches}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(spec["threads"])}
    return python_worker(f"engine-{variant}", sys.executable, str(WORKERS / "engine_worker.py"),
                         s, work, timeout, env)


def vllm_run(spec: dict[str, Any], measures: list[str], batches: list[int], peers: Path,
             work: Path, timeout: float, dtype: str = "float32") -> dict[str, Any]:
    python = peers / "vllm-venv/bin/python"
    if not python.exists():
        return {"error": f"{python} missing: run `make bench-peers-setup` (or minisgl_mp/bench/peer_workers/setup_vllm.sh)"}
    s = {**spec, "measures": measures, "decode_batch_sizes": batches, "dtype": dtype}
    name = "vllm" if dtype == "float32" else f"vllm-{dtype}"
    return python_worker(name, str(python), str(WORKERS / "vllm_worker.py"), s, work, timeout)


def figures(r: dict[str, Any]) -> dict[str, float | None]:
    """The numbers of one system's run that the table and the ratios use."""
    out: dict[str, float | None] = {"fixed_output_tps": (r.get("fixed") or {}).get("output_tps"),
                                    "prefill_tps": (r.get("prefill") or {}).get("tps")}
    for d in r.get("decode") or []:
        out[f"decode_b{d['batch']}_ms"] = d["step_ms"]
    return out


def summarize(results: dict[str, dict[str, Any]], batches: list[int],
              ceiling: dict[str, Any] | None = None) -> dict[str, Any]:
    keys = ["fixed_output_tps", "prefill_tps"] + [f"decode_b{b}_ms" for b in batches]
    fig = {name: figures(r) for name, r in results.items()}
    base = fig.get(BASELINE, {})
    ratios = {name: {k: ratio(f.get(k), base.get(k)) for k in keys} for name, f in fig.items()}
    # An engine variant over vLLM in the same dtype (engine-bfloat16 / vllm-bfloat16), as the
    # engine over vLLM in float32 is ratio_to_engine's "vllm" row inverted.
    pairs = {dt: {k: ratio(fig[f"engine-{dt}"].get(k), fig[f"vllm-{dt}"].get(k)) for k in keys}
             for dt in VLLM_DTYPES if f"engine-{dt}" in fig and f"vllm-{dt}" in fig}
    return {"figures": fig, "ratio_to_engine": ratios, "engine_over_vllm_same_dtype": pairs, "keys": keys,
            "fma_ceiling": ceiling}


def fma_ceiling(config: dict[str, Any], args: argparse.Namespace,
                results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fixed and prefill workloads' FLOPs over the machine's FMA ceiling, measured right
    before each system ran (kernels/csrc/fma_peak.c, same threads): the time no engine can
    beat on this machine. Per system, its time over that floor; and what issue 14's 1.2x of
    vLLM's fixed workload would ask of the engine against the same floor (below 1.0x the
    floor: more than the machine's arithmetic allows)."""
    fixed = decode_floor.workload_flops(config, args.num_prompts, args.input_len, args.output_len)
    prefill = decode_floor.workload_flops(config, args.num_prompts, args.input_len, 1)
    if fixed is None or prefill is None:
        return None
    out: dict[str, Any] = {"fixed_flops": fixed, "prefill_flops": prefill, "systems": {}}
    for name, r in results.items():
        peak = r.get("fma_peak_gflops")
        if not peak or any(f in name for f in NOT_FLOAT32):
            continue
        row: dict[str, Any] = {"fma_peak_gflops": peak}
        for key, flops in (("fixed", fixed), ("prefill", prefill)):
            seconds = (r.get(key) or {}).get("seconds")
            floor = sum(flops.values()) / (peak * 1e9)
            row[f"{key}_floor_s"] = floor
            row[f"{key}_over_floor"] = seconds / floor if seconds else None
        out["systems"][name] = row
    vllm, engine = out["systems"].get("vllm"), out["systems"].get(BASELINE)
    if vllm and engine and vllm["fixed_over_floor"]:
        # The engine's fixed time for 1.2x vLLM's output tok/s, over the engine's own floor.
        need = (results["vllm"]["fixed"]["seconds"] / 1.2) / engine["fixed_floor_s"]
        out["fixed_1_2x_vllm_needs_engine_over_floor"] = need
    return out


def print_table(summary: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    keys = summary["keys"]
    rows, notes = [], []
    for name, f in summary["figures"].items():
        ratios = summary["ratio_to_engine"][name]
        rows.append([name] + [f"{fmt(f.get(k))} ({fmt(ratios[k])}x)" if f.get(k) is not None else "-" for k in keys])
        why = results[name].get("skipped") or results[name].get("error")
        if why:
            notes.append(f"  {name}: {'skipped' if 'skipped' in results[name] else 'failed'}: {why[:300]}")
    print(table(["system (value, x engine)"] + keys, rows))
    print("\n".join(notes))
    for dt, r in (summary.get("engine_over_vllm_same_dtype") or {}).items():
        print(f"engine-{dt} / vllm-{dt}: " + ", ".join(f"{k} {fmt(v)}x" for k, v in r.items() if v is not None))
    ceiling = summary.get("fma_ceiling")
    if ceiling:
        print(table(["system", "FMA ceiling GFLOP/s", "fixed s / floor", "prefill s / floor"],
                    [[name, row["fma_peak_gflops"], row["fixed_over_floor"], row["prefill_over_floor"]]
                     for name, row in ceiling["systems"].items()]))
        need = ceiling.get("fixed_1_2x_vllm_needs_engine_over_floor")
        if need is not None:
            print(f"1.2x vLLM's fixed workload needs the engine at {need:.2f}x its FLOP floor"
                  + (" (below 1: beyond this machine's arithmetic)" if need < 1 else ""))


def plot(summary: dict[str, Any], out: Path, title: str) -> Path | None:
    try:
        plt = plots._pyplot()
    except ImportError:
        return None
    names = list(summary["figures"])
    keys = summary["keys"]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 4.2))
    for ax, key in zip(np.atleast_1d(axes), keys):
        values = [summary["figures"][n].get(key) for n in names]
        ax.bar(range(len(names)), [v if v is not None else 0 for v in values],
               color=["tab:blue" if n.startswith("engine") else "tab:gray" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        better = "higher" if key.endswith("tps") else "lower"
        ax.set_title(f"{key}\n({better} is better)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    return plots._save(plt, fig, title, out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)  # for the FMA ceiling, measured with the systems' threads
    model = prepare_model(args.model, args.load_format, args.checkpoint_dir, args.seed)
    if not model.same_weights or model.hf_weights_dir is None:
        print("bench peers: the peers need a checkpoint on disk (no --load-format dummy without one)", file=sys.stderr)
        return 2
    model_dir = Path(model.hf_weights_dir)
    source = None
    if model_dir.is_file():  # a GGUF file: the engine and llama.cpp run it; the rest its float32 export
        from minisgl_mp.tools.gguf_to_hf import convert

        source = model_dir
        model_dir = args.peers_dir / "checkpoints" / f"{source.stem}-f32"
        if not (model_dir / "model.safetensors").exists():
            print(f"writing {source.name} as a float32 checkpoint to {model_dir} (once)", flush=True)
            convert(source, model_dir)
    config = json.loads(model.config_path.read_text(encoding="utf-8"))
    vocab = config["vocab_size"]
    spec = make_spec(args, model_dir, vocab)
    if source is not None:
        spec["engine_model"] = str(source.resolve())  # int4 / int8 keep the file's own values
    work = args.out.parent / "peers_work"
    work.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}: {model.note}", flush=True)

    def report() -> dict[str, Any]:
        summary = summarize(results, args.decode_batch_sizes, fma_ceiling(config, args, results))
        return {"argv": sys.argv[1:] if argv is None else argv, "model": {"name": args.model, **model.to_dict()},
                "workload": {"fixed": f"{args.num_prompts} x {args.input_len} in x {args.output_len} out",
                             "prefill": f"{args.num_prompts} x {args.input_len} at once",
                             "decode": f"batch {args.decode_batch_sizes} at context {args.decode_context}, "
                                       f"median of {args.decode_steps} steps after {args.warmup_steps}"},
                "threads": args.threads, "machine": machine_info(), "results": results, **summary,
                "wall_seconds": time.perf_counter() - start}

    runs: list[tuple[str, Any]] = []
    if "engine" in args.systems:
        for v in ["float32"] + [v for v in args.engine_variants if v != "float32"]:
            full = v == "float32"
            runs.append((BASELINE if full else f"engine-{v}", lambda v=v, full=full: engine_run(
                v, spec, args.measures if full else args.variant_measures,
                args.decode_batch_sizes if full else args.variant_batch_sizes, work, args.timeout)))
    if "vllm" in args.systems:
        for dt in ["float32"] + [d for d in args.vllm_dtypes if d != "float32"]:
            full = dt == "float32"
            runs.append(("vllm" if full else f"vllm-{dt}", lambda dt=dt, full=full: vllm_run(
                spec, args.measures if full else args.variant_measures,
                args.decode_batch_sizes if full else args.variant_batch_sizes, args.peers_dir, work, args.timeout,
                dt)))
    if "llama" in args.systems:
        for g in args.gguf_types:
            full = g == "f32"
            runs.append((f"llama-{g}", lambda g=g, full=full: llama_run(
                g, model_dir, spec, args.measures if full else args.variant_measures,
                args.decode_batch_sizes if full else args.variant_batch_sizes, args.peers_dir, work, args.timeout,
                source)))
    results: dict[str, dict[str, Any]] = {}
    if args.reuse:
        earlier = json.loads(args.reuse.read_text(encoding="utf-8"))
        now = {name for name, _ in runs}
        results |= {name: {**r, "reused_from": str(args.reuse)} for name, r in earlier["results"].items()
                    if name not in now}
    for name, run in runs:
        print(f"== {name}", flush=True)
        peak = cpu_kernels.fma_peak_gflops()  # right before each system: the host's rate drifts
        results[name] = run()
        results[name]["fma_peak_gflops"] = peak
        print(json.dumps({k: v for k, v in figures(results[name]).items() if v is not None}),
              results[name].get("skipped") or results[name].get("error") or "", flush=True)
        write_json(args.out, report())  # after each system, so a long run keeps what it measured
    final = report()
    print_table(final, results)
    png = plot(final, args.plot, f"{args.model}, {args.threads} threads each ({final['machine']['cpu_model']})")
    final["plot"] = str(png) if png else "matplotlib missing: no plot"
    out = write_json(args.out, final)
    print(f"wrote {out}" + (f" and {png}" if png else "") + f" ({final['wall_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
