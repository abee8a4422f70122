"""Prompt log-probabilities (what lm-eval's loglikelihood tasks read) against transformers'
float32 log_softmax: whole prompts, chunked prefill, a radix-cache hit, and a start position."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import hf_logits, load_hf_model, torch_threads
from minisgl_mp import LLM, SamplingParams

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> torch.nn.Module:
    return load_hf_model(tiny_model_dir)


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "num_pages": 1024, "max_running_requests": 8}
    return LLM(str(model_dir), **(defaults | kwargs))


def reference(hf: torch.nn.Module, ids: list[int], start: int, k: int) -> list[tuple[float, list[int]]]:
    """(logprob of token p, top-k ids at p) for p in [max(start, 1), len(ids))."""
    logprobs = torch.log_softmax(hf_logits(hf, ids).float(), dim=-1)
    return [(float(logprobs[p - 1, ids[p]]), logprobs[p - 1].topk(k).indices.tolist() if k else [])
            for p in range(max(start, 1), len(ids))]


def check(got: list[Any], want: list[tuple[float, list[int]]], k: int) -> None:
    assert len(got) == len(want)
    for entry, (lp, top) in zip(got, want):
        assert abs(entry.token_logprob - lp) < TOL
        assert len(entry.top_ids) == k
        if k:  # the top-1 may differ from transformers' only on a near-tie
            assert entry.top_ids[0] == top[0] or abs(entry.top_logprobs[0] - entry.top_logprobs[1]) < TOL


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir)


@pytest.mark.parametrize("chunk", [None, 7])  # one forward; chunked prefill, 7 tokens a step
def test_prompt_logprobs_match_transformers(tiny_model_dir: Path, llm: LLM, hf: torch.nn.Module,
                                            chunk: int | None) -> None:
    if chunk is not None:
        llm = make_llm(tiny_model_dir, max_prefill_tokens=chunk)
    llm.scheduler.flush_cache()
    ids = llm.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=2, logprob_start_len=0))[0]
    check(out["prompt_logprobs"], reference(hf, ids, 0, 2), 2)


def test_prompt_logprobs_after_a_cache_hit_and_from_a_start(llm: LLM, hf: torch.nn.Module) -> None:
    ids = llm.encode(PROMPT)
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))  # the whole prompt is now cached
    before = llm.scheduler.stats.prefill_tokens
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=0, logprob_start_len=0))[0]
    check(out["prompt_logprobs"], reference(hf, ids, 0, 0), 0)
    assert llm.scheduler.stats.prefill_tokens - before == len(ids)  # recomputed: the cache holds no logits

    start = len(ids) - 4
    before = llm.scheduler.stats.prefill_tokens
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=1, logprob_start_len=start))[0]
    check(out["prompt_logprobs"], reference(hf, ids, start, 1), 1)
    # Only from the position before `start` is recomputed; the rest comes from the cache.
    assert llm.scheduler.stats.prefill_tokens - before == len(ids) - (start - 1)
    assert out["usage"]["cached_tokens"] == start - 1


def test_requests_without_prompt_logprobs_get_none(llm: LLM) -> None:
    outs = llm.generate([PROMPT, PROMPT + " again"],
                        [SamplingParams(max_tokens=2, temperature=0, logprobs=1),
                         SamplingParams(max_tokens=2, temperature=0, logprobs=0, logprob_start_len=3)])
    assert outs[0]["prompt_logprobs"] == []
    assert len(outs[1]["prompt_logprobs"]) == len(llm.encode(PROMPT + " again")) - 3
    assert len(outs[0]["logprobs"]) == len(outs[1]["logprobs"]) == 2
