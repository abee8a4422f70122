"""Timing a workload through a generate function, and the engine's generate function.

Every system under test (the engine, Hugging Face static batches, Hugging Face continuous
batching) is a `GenerateFn`: prompts and output lengths in, output token ids out. The round
runner feeds it a workload round by round and times only those calls.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm import tqdm

from minisgl_mp.bench.workloads import Workload, round_prompts
from minisgl_mp.llm import LLM
from minisgl_mp.sampling_params import SamplingParams

# (prompts, output lengths) -> output token ids, exactly output_lens[i] of them for prompt i.
GenerateFn = Callable[[list[list[int]], list[int]], list[list[int]]]

ENGINE_STAT_KEYS = ("steps", "prefill_tokens", "decode_tokens", "cached_prompt_tokens", "retractions")


@dataclass(frozen=True)
class RunResult:
    system: str
    seconds: float
    requests: int
    input_tokens: int
    output_tokens: int  # each request's own output tokens (what a user asked for)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        s = self.seconds
        return {"system": self.system, "seconds": s, "requests": self.requests,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "request_throughput": self.requests / s, "input_tps": self.input_tokens / s,
                "output_tps": self.output_tokens / s,
                "total_tps": (self.input_tokens + self.output_tokens) / s, **self.extra}


def run_workload(system: str, workload: Workload, generate: GenerateFn,
                 extra: Callable[[], dict[str, Any]] | None = None) -> RunResult:
    """All rounds of `workload` through `generate`; raises if an output has the wrong length
    (its throughput would be wrong too)."""
    history: list[list[int]] = [[] for _ in workload.conversations]
    seconds, input_tokens, output_tokens = 0.0, 0, 0
    for k in range(workload.num_rounds):
        idx, prompts, out_lens = round_prompts(workload, k, history)
        start = time.perf_counter()
        outputs = generate(prompts, out_lens)
        seconds += time.perf_counter() - start
        for i, p, o, n in zip(idx, prompts, outputs, out_lens):
            if len(o) != n:
                raise RuntimeError(f"{system}: a request asked for {n} tokens and got {len(o)}")
            history[i] = p + list(o)
        input_tokens += sum(len(p) for p in prompts)
        output_tokens += sum(out_lens)
    return RunResult(system, seconds, workload.num_requests, input_tokens, output_tokens,
                     extra() if extra is not None else {})


class EngineRunner:
    """Drives the offline engine's scheduler directly: token ids in and out, no detokenizer
    (as Hugging Face's generate), with a progress bar over finished requests."""

    def __init__(self, llm: LLM, progress: bool = True) -> None:
        self.llm = llm
        self.progress = progress
        self._ids = itertools.count()
        self._start_stats = self.stats()

    def stats(self) -> dict[str, int]:
        s = self.llm.scheduler.engine_stats()
        return {k: int(s[k]) for k in ENGINE_STAT_KEYS}

    def reset_stats(self) -> None:
        self._start_stats = self.stats()

    def stats_delta(self) -> dict[str, int]:
        now = self.stats()
        return {k: now[k] - self._start_stats[k] for k in ENGINE_STAT_KEYS}

    def generate(self, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
        sched = self.llm.scheduler
        rids = []
        for p, n in zip(prompts, out_lens):
            rid = f"bench-{next(self._ids)}"
            sched.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            rids.append(rid)
        outputs: dict[str, list[int]] = {rid: [] for rid in rids}
        with tqdm(total=len(rids), desc="engine", unit="req", disable=not self.progress, leave=False) as bar:
            while sched.has_work:
                for out in sched.step():
                    outputs[out.rid].extend(out.new_token_ids)
                    if out.finished:
                        bar.update(1)
        return [outputs[rid] for rid in rids]

    def warmup(self, token_range: int) -> None:
        """A few short requests (first-call costs: oneDNN kernels, allocator), then an empty cache."""
        self.generate([[i % token_range for i in range(1, 17)], [7, 8, 9]], [4, 4])
        self.llm.scheduler.flush_cache()
        self.reset_stats()


def run_engine(llm: LLM, workload: Workload, token_range: int, system: str = "engine",
               progress: bool = True) -> RunResult:
    runner = EngineRunner(llm, progress)
    runner.warmup(token_range)
    return run_workload(system, workload, runner.generate, extra=lambda: {"engine_stats": runner.stats_delta()})
