"""What prompt log-probabilities cost: scoring prompts (lm-eval's loglikelihood: one generated
token) with every prompt position through the LM head, against the same prompts without.

    python launch/bench_prompt_logprobs.py                                 # the tiny model
    python launch/bench_prompt_logprobs.py --model Qwen3-0.6B --load-format dummy --num-prompts 8
"""

from __future__ import annotations

import argparse
import time

import torch

from minisgl_mp import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qwen3-tiny")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    # Both runs prefill the same chunks: prompt log-probabilities cap a step at 512 tokens anyway.
    ap.add_argument("--max-prefill-tokens", type=int, default=512)
    args = ap.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype="float32", max_prefill_tokens=args.max_prefill_tokens,
              num_pages=args.num_prompts * (args.prompt_len + 8))
    vocab = llm.scheduler.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    plain = SamplingParams(max_tokens=1, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, logprobs=1, logprob_start_len=0)
    llm.generate(prompts[:1], scored)  # warm up
    times: dict[str, list[float]] = {"without prompt logprobs": [], "with prompt logprobs (top-1)": []}
    for _ in range(args.repeats):
        for name, params in zip(times, (plain, scored)):
            llm.scheduler.flush_cache()
            start = time.perf_counter()
            llm.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    tokens = args.num_prompts * args.prompt_len
    base = min(times["without prompt logprobs"])
    print(f"{args.model}: {args.num_prompts} prompts x {args.prompt_len} tokens, best of {args.repeats}")
    for name, ts in times.items():
        print(f"  {name:30s} {min(ts):7.3f} s  {tokens / min(ts):9.0f} prompt tok/s  {min(ts) / base:5.2f}x")


if __name__ == "__main__":
    main()
