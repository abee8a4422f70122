"""N-gram speculative decoding against plain decoding, on the same requests in the same run.

    python -m minisgl_mp.bench spec                     # SmolLM2-135M-Instruct, every workload
    python -m minisgl_mp.bench spec --workloads copy --num-draft-tokens 4,8
    python -m minisgl_mp.bench spec --no-hf             # without transformers' prompt lookup

Workloads, chat prompts to the instruction-tuned model, greedy:
  copy        one request at a time, each asking to repeat, lightly edit or extract from a passage
              it is given (the work n-gram drafts are for);
  free        one request at a time, open questions with nothing to copy (drafting must not cost);
  copy-batch  the copy prompts, `--concurrency` at once;
  free-batch  the open questions, `--concurrency` at once (each numbered, so no two are the same).
Each runs with the engine plain, then with `--speculative-algorithm NGRAM` per draft length and
cap, all loaded in one process; with `--repeats N` the configurations take turns N times (the
prefix cache flushed before each run) and the median run counts, so drift on the host falls on
all alike. The answers must be identical token for token (the run says where they are not);
output tok/s, the ratio to plain, and the accepted length (tokens per verification step) are
printed and written as JSON. Beside them, batch 1
only, transformers' own n-gram speculation: `generate(prompt_lookup_num_tokens=K)` against its
plain `generate`, the first thing a transformers user would try.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

from minisgl_mp.bench.report import machine_info, ratio, table, write_json
from minisgl_mp.llm import LLM
from minisgl_mp.sampling_params import SamplingParams

WORKLOADS = ("copy", "free", "copy-batch", "free-batch")

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. Every night "
    "for ninety years its lamp had turned, warning ships away from the rocks below. The keeper, a quiet man "
    "named Thomas, climbed the one hundred and twelve steps at dusk and came down again at dawn.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of yeast. Add three "
    "hundred and fifty millilitres of warm water and knead the dough for ten minutes, until it is smooth. Let "
    "it rise for an hour, shape it into a loaf, and bake it at two hundred and twenty degrees for thirty minutes.",
    "The meeting is moved from Tuesday to Thursday at three in the afternoon. Please bring the quarterly "
    "report, the budget for the new office and your notes on the hiring plan. The room on the fourth floor "
    "is booked, and coffee will be served. If you cannot attend, send your comments to Maria before Wednesday.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed forests and "
    "fields, and give towns their water. In spring the snow melts and the rivers rise; in late summer they "
    "run low and slow. People have built their cities beside rivers for as long as there have been cities.",
    "Dear Alex, thank you for your letter and for the photographs of the garden. The roses look wonderful "
    "this year, and I was glad to hear that the apple tree finally gave fruit. We will visit in August, as "
    "planned, and stay for a week. Give my love to everyone, and tell Sam that I still have his book.",
    "Step one: turn off the power at the main switch. Step two: remove the cover plate with a screwdriver. "
    "Step three: disconnect the old switch, noting which wire goes where. Step four: connect the new switch "
    "the same way. Step five: replace the cover plate and turn the power back on.",
    "The committee reviewed twelve proposals this year. Four were accepted, five were returned for revision, "
    "and three were declined. The accepted proposals cover water quality, school transport, a public library "
    "extension and a new cycling path along the river. Work on all four begins in the spring.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy the following text, but write every number in digits:\n\n{}",
    "Rewrite the following text exactly as it is, keeping every word:\n\n{}",
    "Fix any typos in the following text and return the whole text:\n\n{}",
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a child.",
    "What are three good habits for staying healthy? Explain each.",
    "Describe a walk through a forest in autumn.",
    "Why is the sky blue? Answer in a paragraph.",
    "Write a poem about the moon.",
    "Give advice to someone starting their first job.",
    "What is the difference between weather and climate?",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl_mp.bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M-Instruct from `make model`)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--num-draft-tokens", default="4", help="draft lengths to run, comma-separated (default 4)")
    p.add_argument("--max-batch-tokens", default=None,
                   help="--speculative-max-batch-tokens values to run, comma-separated (default: the engine's)")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per workload (default 8)")
    p.add_argument("--concurrency", type=int, default=32, help="the batch workloads: requests at once (default 32)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration, taking turns; the median counts (default 1)")
    p.add_argument("--max-tokens", type=int, default=160, help="output limit per request (default 160)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' generate, plain and with prompt_lookup_num_tokens (batch 1)")
    p.add_argument("--hf-prompts", type=int, default=4, help="requests per batch-1 workload for transformers")
    p.add_argument("--out", default="bench_results/spec.json")


def workload_prompts(llm: LLM, workload: str, n: int, concurrency: int) -> list[list[int]]:
    if workload == "free":
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    elif workload == "free-batch":
        texts = [f"Question {i + 1}. {QUESTIONS[i % len(QUESTIONS)]}" for i in range(concurrency)]
    else:
        count = concurrency if workload == "copy-batch" else n
        texts = [TASKS[i % len(TASKS)].format(PASSAGES[i % len(PASSAGES)]) for i in range(count)]
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False) for t in texts]


def timed_generate(llm: LLM, prompts: list[list[int]], batch: bool, params: SamplingParams) -> dict[str, Any]:
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, temperature=0))  # warm the kernels
    before = llm.scheduler.engine_stats()
    t0 = time.perf_counter()
    if batch:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate(p, params)[0] for p in prompts]
    elapsed = time.perf_counter() - t0
    after = llm.scheduler.engine_stats()
    tokens = sum(len(o["token_ids"]) for o in outs)
    verify = sum(o["usage"].get("spec_verify_ct", 0) for o in outs)
    accepted = sum(o["usage"].get("spec_verify_ct", 0) * (o["usage"].get("spec_accept_length", 1.0) - 1)
                   for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tps": tokens / elapsed,
            "spec_verify_ct": verify, "spec_accept_length": 1 + accepted / verify if verify else None,
            # The steps it took and the draft tokens they ran: in a batch the steps are set by
            # its slowest request, so drafts that do not shorten it only cost rows.
            **{k: after[k] - before[k] for k in ("steps", "spec_drafted_tokens", "spec_accepted_tokens")},
            "token_ids": [o["token_ids"] for o in outs]}


def _run_hf(hf: Any, prompts: list[list[int]], max_tokens: int, lookup: int | None) -> dict[str, Any]:
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    outs, t0 = [], time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          **kwargs)
        outs.append(out[0, len(p):].tolist())
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tps": tokens / elapsed, "token_ids": outs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        print(f"unknown workload(s) {bad}; choose from {WORKLOADS}", file=sys.stderr)
        return 2
    drafts = [int(k) for k in args.num_draft_tokens.split(",")]
    if args.model is None:
        from minisgl_mp.tools.fetch_model import DEFAULT_OUT, fetch

        args.model = str(fetch(DEFAULT_OUT).parent)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engine_kwargs = {"device": "cpu", "dtype": args.dtype, "quantization": args.quantization,
                     "max_running_requests": max(args.concurrency, 16), "num_pages": 32768}
    caps = [int(c) for c in args.max_batch_tokens.split(",")] if args.max_batch_tokens else [None]
    configs = [("plain", {})]
    for k in drafts:
        for cap in caps:
            extra = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k}
            if cap is not None:
                extra["speculative_max_batch_tokens"] = cap
            configs.append((f"ngram-k{k}" + (f"-cap{cap}" if cap is not None else ""), extra))
    results: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    prompts: dict[str, list[list[int]]] = {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    llms = {name: LLM(args.model, **engine_kwargs, **extra) for name, extra in configs}
    for _ in range(max(args.repeats, 1)):
        for name, llm in llms.items():
            for w in workloads:
                prompts.setdefault(w, workload_prompts(llm, w, args.num_prompts, args.concurrency))
                llm.scheduler.flush_cache()
                r = timed_generate(llm, prompts[w], w.endswith("-batch"), params)
                runs.setdefault((w, name), []).append(r)
                print(f"{w:10s} {name:9s} {r['output_tps']:7.1f} tok/s  accept {r['spec_accept_length'] or '-'}",
                      flush=True)
    for (w, name), rs in runs.items():
        median = sorted(rs, key=lambda r: r["output_tps"])[len(rs) // 2]
        results[w][name] = {**median, "runs_output_tps": [r["output_tps"] for r in rs]}
    for llm in llms.values():
        llm.shutdown()
    del llms
    gc.collect()
    if args.hf:
        _hf_runs(args, workloads, prompts, results, drafts)

    rows, summary = [], {}
    for w in workloads:
        base = results[w]["plain"]
        for name, r in results[w].items():
            ref = results[w]["hf-generate"] if name.startswith("hf-") else base
            n = min(len(r["token_ids"]), len(ref["token_ids"]))
            r["identical"] = sum(a == b for a, b in zip(r["token_ids"][:n], ref["token_ids"][:n]))
            r["compared"] = n
            r["speedup"] = ratio(r["output_tps"], ref["output_tps"])
            rows.append([w, name, r["output_tokens"], r["output_tps"], r["speedup"], r["spec_accept_length"]
                         if "spec_accept_length" in r else None, f"{r['identical']}/{n}"])
        summary[w] = {name: r["speedup"] for name, r in results[w].items()}
    print()
    print(table(["workload", "system", "tokens", "tok/s", "x own plain", "accept len", "identical"], rows))
    report = {"bench": "spec", "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "max_tokens": args.max_tokens, "concurrency": args.concurrency, "repeats": args.repeats,
              "machine": machine_info(),
              "date": time.strftime("%Y-%m-%d"), "speedups": summary,
              "results": {w: {n: {k: v for k, v in r.items() if k != "token_ids"} for n, r in rs.items()}
                          for w, rs in results.items()}}
    print(f"wrote {write_json(Path(args.out), report)}")
    mismatched = [(w, n) for w, rs in results.items() for n, r in rs.items()
                  if not n.startswith("hf-") and r["identical"] != r["compared"]]
    if mismatched:
        print(f"answers differ from plain decoding in {mismatched}", file=sys.stderr)
        return 1
    return 0


def _hf_runs(args: argparse.Namespace, workloads: list[str], prompts: dict[str, list[list[int]]],
             results: dict[str, dict[str, Any]], drafts: list[int]) -> None:
    """transformers on the same file, float32, batch 1: plain generate and prompt lookup."""
    from transformers import AutoModelForCausalLM

    from minisgl_mp.models.source import resolve_model

    src = resolve_model(args.model)
    gguf = Path(src.weights) if str(src.weights).endswith(".gguf") else None
    if gguf is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(src.weights), dtype=torch.float32)
    hf.eval()
    with torch.inference_mode():
        for w in workloads:
            if w.endswith("-batch"):
                continue
            some = prompts[w][:args.hf_prompts]
            results[w]["hf-generate"] = _run_hf(hf, some, args.max_tokens, None)
            for k in drafts:
                results[w][f"hf-lookup-k{k}"] = _run_hf(hf, some, args.max_tokens, k)
            for name in ["hf-generate"] + [f"hf-lookup-k{k}" for k in drafts]:
                print(f"{w:10s} {name:14s} {results[w][name]['output_tps']:7.1f} tok/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
