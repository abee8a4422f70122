"""What sampling costs a step: the engine's sampler against transformers' logits warpers plus
`torch.multinomial` (what `generate(do_sample=True)` runs), on the same logits, in one run.

    python launch/bench_sampler.py --out bench_results/sampler.json
    python launch/bench_sampler.py --batch-sizes 1,64 --vocab 151936 --reps 5

The logits are random but peaked the way a language model's are (a few dozen tokens far above
the rest), over Qwen3's vocabulary. Each case gives every row the same parameters, since the
transformers warpers take one value for the whole batch. Times are the best of `--reps` calls.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from minisgl_mp.bench.decode_floor import best_seconds
from minisgl_mp.bench.report import machine_info, write_json
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.req import Req
from minisgl_mp.scheduler.sampler import Sampler

CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_k=50": {"temperature": 0.8, "top_k": 50},
    "top_p=0.9": {"temperature": 0.8, "top_p": 0.9},
    "min_p=0.05": {"temperature": 0.8, "min_p": 0.05},
    "repetition=1.1": {"temperature": 0.8, "repetition_penalty": 1.1},
}
HISTORY = 256  # prompt and output tokens each request has, for the penalties


def hf_sampler(case: dict[str, Any], history: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    if case["temperature"] == 0:
        return lambda logits: logits.argmax(dim=-1)
    procs = LogitsProcessorList()
    if case.get("repetition_penalty"):
        procs.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    procs.append(TemperatureLogitsWarper(case["temperature"]))
    if case.get("top_k"):
        procs.append(TopKLogitsWarper(case["top_k"]))
    if case.get("top_p"):
        procs.append(TopPLogitsWarper(case["top_p"]))
    if case.get("min_p"):
        procs.append(MinPLogitsWarper(case["min_p"]))

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = procs(history, logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    return sample


def engine_sampler(case: dict[str, Any], history: torch.Tensor, vocab: int) -> Callable[[torch.Tensor], list[int]]:
    params = SamplingParams(max_tokens=1 << 20, **case)
    sampler = Sampler(vocab, torch.device("cpu"), rows=history.shape[0])
    reqs = []
    for i, ids in enumerate(history.tolist()):
        req = Req(f"r{i}", ids[: HISTORY // 2], params, 1 << 30, frozenset())
        req.token_ids += ids[HISTORY // 2:]
        req.row = i
        reqs.append(req)
    sampler.bind(reqs)
    return lambda logits: sampler.sample(logits, reqs).resolve().token_ids


def best_ms(fn: Callable[[], Any], reps: int) -> float:
    return 1e3 * min(best_seconds(fn, reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="bench_results/sampler.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'case':16s} {'batch':>5s} {'engine ms':>10s} {'transformers ms':>16s} {'ratio':>6s}")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        logits = torch.randn(b, args.vocab, generator=gen) * 2
        peaks = torch.randint(args.vocab, (b, 32), generator=gen)
        logits.scatter_add_(1, peaks, torch.full((b, 32), 12.0))
        history = torch.randint(args.vocab, (b, HISTORY), generator=gen)
        for name, case in CASES.items():
            engine = engine_sampler(case, history, args.vocab)
            hf = hf_sampler(case, history)
            e_ms = best_ms(lambda: engine(logits), args.reps)
            h_ms = best_ms(lambda: hf(logits), args.reps)
            rows.append({"case": name, "batch": b, "engine_ms": round(e_ms, 2), "transformers_ms": round(h_ms, 2),
                         "engine_over_transformers": round(e_ms / h_ms, 3)})
            print(f"{name:16s} {b:5d} {e_ms:10.2f} {h_ms:16.2f} {e_ms / h_ms:6.2f}", flush=True)
    out = write_json(args.out, {"machine": machine_info(), "vocab": args.vocab, "threads": torch.get_num_threads(),
                                "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
