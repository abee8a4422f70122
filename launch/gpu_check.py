"""The GPU check: everything about the CUDA path that CI on the CPU cannot show, in one run.

    python launch/gpu_check.py                         # one GPU, under 6 minutes: bench_results/gpu_check.json
    python launch/gpu_check.py --device cpu --quick    # the same checks at toy sizes on the CPU (CI runs this)

Checks, each recorded in the JSON with `ok` (the exit status is 1 when any failed):
- greedy tokens judged by transformers in float32 on the same weights, on the generated model
  and on the Qwen3-0.6B shape (random weights written once, loaded by both); in bfloat16 the
  engine's choices must be as good as transformers' own in bfloat16;
- every attention backend that runs here against sdpa;
- a 32k-token prompt, alone and among 255 short requests (must not run out of memory);
- offline throughput on the Qwen3-0.6B shape, 256 requests with input and output lengths
  U(100, 1024) (nano-vllm's published setting), with and without CUDA graphs;
- decode step time at batch 1, 64 and 256, with and without CUDA graphs;
- the kernels a batch-1 decode step launches and their device time, with and without
  `--cuda-fused-ops` (torch.profiler on the eager engine);
- the greedy, throughput and decode checks also without `--cuda-fused-ops` (the Triton kernels
  for the layers' element-wise steps, on by default);
- the server users start (launcher, tokenizer, scheduler and detokenizer processes) on the
  device: greedy outputs through the ZMQ client and the OpenAI API equal the offline engine's,
  and out tok/s with 64 streams on each frontend beside the offline engine's;
- overlap scheduling's outputs against those without it (greedy, seeded, penalized), and its
  decode steps free of syncs other than the one for the previous step's tokens;
- n-gram speculative decoding on the defaults (verify steps in CUDA graphs, overlap scheduling)
  on the real default model, in float32: greedy and seeded answers identical to plain decoding,
  the verify graphs replayed, copy-heavy out tok/s one request at a time with and without it;
- transformers `generate` (static batches) on the first 64 requests, as the baseline.
The report is rewritten after every check, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from minisgl_mp.bench import gpu_check as checks
from minisgl_mp.bench.checkpoints import prepare_model
from minisgl_mp.bench.report import machine_info, write_json
from minisgl_mp.llm import LLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --quick: a smoke run)")
    p.add_argument("--quick", action="store_true", help="toy sizes, the generated model only")
    p.add_argument("--dtype", help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--model", default="Qwen3-0.6B", help="the large shape (default Qwen3-0.6B; --quick: the small model)")
    p.add_argument("--small-model", default="models/qwen3-tiny", help="the generated model")
    p.add_argument("--spec-model", default="models/SmolLM2-135M-Instruct",
                   help="speculative decoding's check (default: the real default model; the small one where it is absent)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("bench_results/checkpoints"))
    p.add_argument("--attention-backend", default="auto",
                   help="the engines' backend (default: the engine's own choice for the device)")
    p.add_argument("--only", help="comma-separated prefixes of the checks to run (default: all), "
                   "e.g. greedy,throughput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/gpu_check.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    sizes = checks.QUICK if args.quick else checks.FULL
    tol = 1e-3 if dtype == torch.float32 else 0.5  # logit gap allowed for a greedy choice (see greedy_vs_hf)
    only = tuple(args.only.split(",")) if args.only else ("",)
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    small = prepare_model(args.small_model, None, args.checkpoint_dir, args.seed)
    large = small if args.quick else prepare_model(args.model, None, args.checkpoint_dir, args.seed)
    vocab = json.loads(large.config_path.read_text(encoding="utf-8"))["vocab_size"]
    results: dict[str, Any] = {}
    report: dict[str, Any] = {"machine": machine_info(), "device": args.device, "dtype": str(dtype),
                              "quick": args.quick, "sizes": asdict(sizes), "models": {"small": small.to_dict(),
                              "large": large.to_dict()}, "checks": results}

    def run(name: str, fn: Any) -> None:
        if not name.startswith(only):
            return
        checks.run_check(name, fn, results, log)
        report["seconds"] = round(time.perf_counter() - started, 1)
        write_json(args.out, report)

    run("greedy_vs_hf_small", lambda: checks.greedy_vs_hf(small, args.device, dtype, sizes, tol, args.seed,
                                                                args.attention_backend))
    if not args.quick:
        run("greedy_vs_hf_large", lambda: checks.greedy_vs_hf(large, args.device, dtype, sizes, tol, args.seed,
                                                                    args.attention_backend))
        if cuda:  # the element-wise steps as PyTorch's ops, without the Triton kernels
            run("greedy_vs_hf_large_unfused", lambda: checks.greedy_vs_hf(
                large, args.device, dtype, sizes, tol, args.seed, args.attention_backend, cuda_fused_ops=False))
    run("backends_vs_sdpa", lambda: checks.backends_vs_sdpa(torch.device(args.device), dtype, args.seed, args.quick))

    run("kernels_per_step", lambda: checks.kernels_per_step(large, args.device, dtype, vocab, args.seed,
                                                            attention_backend=args.attention_backend))
    run("served", lambda: checks.served(large, args.device, dtype, sizes, vocab, args.seed, args.attention_backend,
                                        args.out.with_name(args.out.stem + "_server.log")))
    run("overlap_agrees", lambda: checks.overlap_agrees(small, args.device, dtype, args.seed,
                                                                   args.attention_backend))
    # Random weights copy nothing: the real model where it is (`make model`), so drafts are accepted.
    spec_model = args.spec_model if Path(args.spec_model).exists() else small.engine_model
    run("speculative", lambda: checks.speculative(spec_model, args.device, args.quick, args.attention_backend))
    # (tag, disable_cuda_graph, disable_overlap_schedule, cuda_fused_ops): no graphs, overlap or
    # Triton element-wise kernels on the CPU.
    modes = [("eager", True, True, False), ("cuda_graph", False, True, False),
             ("cuda_graph_overlap", False, False, False), ("cuda_graph_overlap_fused", False, False, True)] \
        if cuda else [("eager", True, True, False)]
    defaults = "cuda_graph_overlap_fused" if cuda else "eager"
    for tag, disable_graph, disable_overlap, fused in modes:
        last = tag == defaults  # the long-context and sync checks run on the engine with the defaults
        names = [f"throughput_{tag}", f"decode_steps_{tag}"] + (["long_context", "hidden_syncs"] if last else [])
        if not any(n.startswith(only) for n in names):
            continue
        kwargs = checks.engine_kwargs(args.device, dtype, max(sizes.decode_batches + (sizes.skew_short + 1,)),
                                      args.attention_backend)
        context = max(sizes.long_prompt + 64, sizes.decode_context + 64, 2 * sizes.throughput_lens[1] + 8)
        llm = LLM(large.engine_model, load_format=large.engine_load_format, disable_cuda_graph=disable_graph,
                  disable_overlap_schedule=disable_overlap, cuda_fused_ops=fused, context_length=context, **kwargs)
        log(f"engine ({tag}): attention {llm.scheduler.runner.attention_backend}, overlap {llm.scheduler.overlap}")
        if last:
            run("long_context", lambda: checks.long_context(llm, sizes, vocab, args.seed))
            run("hidden_syncs", lambda: checks.hidden_syncs(llm, vocab, args.seed))
        run(f"throughput_{tag}", lambda: checks.throughput(llm, sizes, vocab, args.seed))
        run(f"decode_steps_{tag}", lambda: checks.decode_steps(llm, sizes, vocab, args.seed))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run("hf_generate_baseline", lambda: checks.hf_baseline(large, args.device, dtype, sizes, vocab, args.seed))

    report["seconds"] = round(time.perf_counter() - started, 1)
    out = write_json(args.out, report)
    failed = [k for k, v in results.items() if v.get("ok") is False]
    log(f"wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
