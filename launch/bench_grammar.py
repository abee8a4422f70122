"""What a grammar costs a decode step: the median step time of a batch whose every request is
held to a JSON schema, against the same batch unconstrained, at batch 1 and 32; and the mask
alone (fill every row's bitmask, apply it to the logits).

    python launch/bench_grammar.py                                  # the tiny model (8k vocabulary)
    python launch/bench_grammar.py --model Qwen3-0.6B --load-format dummy --steps 12   # Qwen's 152k

Writes bench_results/bench_grammar.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.bench.decode_floor import median_ms
from minisgl_mp.constrained.base import GrammarKey

# An array of nested objects that cannot end within the run: every step is a constrained decode.
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,10}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}},
              "required": ["id", "vip"]}},
    "required": ["name", "age", "kind", "owner"]}
SCHEMA = json.dumps({"type": "array", "items": ITEM, "minItems": 100})


def decode_step_ms(llm: LLM, batch: int, steps: int, constrained: bool) -> float:
    """Median time of the steps in which all `batch` requests decode."""
    s = llm.scheduler
    extra: dict[str, Any] = {"json_schema": SCHEMA} if constrained else {}
    for i in range(batch):
        s.add_request(f"{constrained}-{batch}-{i}", [1 + i, 2, 3, 4],
                      SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=1.0, seed=i, **extra))
    times = []
    while s.has_work:
        decoding = len(s.running) == batch and all(r.is_decoding for r in s.running)
        t = time.perf_counter()
        s.step()
        if decoding:
            times.append(time.perf_counter() - t)
    s.flush_cache()
    return 1e3 * statistics.median(times)


def mask_only_ms(llm: LLM, batch: int) -> float:
    g = llm.scheduler.grammar
    matchers = [g.matcher(g.compile(GrammarKey("json_schema", SCHEMA)).result()) for _ in range(batch)]
    for m in matchers:  # into an item, past the opening bracket
        for t in llm.encode('[{"name": "ab'):
            m.accept_token(t)
    logits = torch.zeros(batch, llm.scheduler.runner.model_config.vocab_size)
    return median_ms(lambda: g.fill_and_apply(logits, matchers, list(range(batch))), reps=20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qwen3-tiny")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each; the best median counts")
    ap.add_argument("--out", default="bench_results/bench_grammar.json")
    args = ap.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype="float32", num_pages=4096)
    vocab = llm.scheduler.runner.model_config.vocab_size
    decode_step_ms(llm, 2, 4, True)  # warm up, and compile the grammar once (it is cached)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        # Interleaved, best of `repeats`: other work on the machine slows both alike.
        runs = [(decode_step_ms(llm, batch, args.steps, False), decode_step_ms(llm, batch, args.steps, True))
                for _ in range(args.repeats)]
        plain, held = min(p for p, _ in runs), min(h for _, h in runs)
        mask = mask_only_ms(llm, batch)
        rows.append({"batch": batch, "plain_step_ms": plain, "json_schema_step_ms": held,
                     "ratio": held / plain, "mask_only_ms": mask})
        print(f"batch {batch:3d}: step {plain:7.2f} ms plain, {held:7.2f} ms under a JSON schema "
              f"(x{held / plain:.2f}); the mask alone {mask:.2f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "vocab_size": vocab, "steps": args.steps,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
