"""The offline engine on the generated model (float32, CPU): greedy outputs agree with
transformers, and prefix caching, retraction, chunked prefill, page sizes and batch shapes
never change them, nor leak KV pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import check_teacher_forced, load_hf_model, torch_threads
from minisgl_mp import LLM, SamplingParams

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
TEXT_PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
    "import os\nimport sys\n\n",
    "A list of the standard library modules: argparse, textwrap, typing, subprocess, threading, "
    "functools, dataclasses, inspect, difflib and doctest, each with its own documentation.",
]
ID_PROMPTS = [[7], [300, 301, 302], list(range(1000, 1120)), [42] * 9]
Prompts = list[list[int]]
Outputs = list[dict[str, Any]]  # what LLM.generate returns


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "num_pages": 2048, "max_running_requests": 32}
    return LLM(str(model_dir), **(defaults | kwargs))


def assert_no_leak(llm: LLM) -> None:
    llm.scheduler.check_health()
    s = llm.scheduler.engine_stats()
    assert s["running"] == s["waiting"] == 0
    assert s["protected_tokens"] == 0, f"idle but {s['protected_tokens']} cached tokens are locked"
    assert s["free_tokens"] + s["evictable_tokens"] == s["total_tokens"], f"KV pages leaked: {s}"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> Prompts:
    return [llm.encode(p) for p in TEXT_PROMPTS + ID_PROMPTS]


@pytest.fixture(scope="module")
def reference(llm: LLM, prompt_ids: Prompts) -> Outputs:
    """The engine's greedy outputs for every prompt, run together (checked against HF below)."""
    return llm.generate(prompt_ids, GREEDY)


def token_ids(outputs: Outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


@pytest.mark.timeout(180)
def test_greedy_batch_matches_transformers(tiny_model_dir: Path, prompt_ids: Prompts,
                                           reference: Outputs) -> None:
    assert len({len(p) for p in prompt_ids}) >= 8, "prompts of different lengths"
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(prompt_ids, reference):
        assert out["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["usage"]["completion_tokens"] == len(out["token_ids"]) == MAX_TOKENS
        check_teacher_forced(hf, prompt, out["token_ids"])


@pytest.mark.timeout(120)
def test_text_is_the_decoded_tokens(llm: LLM, reference: Outputs) -> None:
    for out in reference:
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


@pytest.mark.timeout(120)
def test_rerun_computes_one_prefill_token_per_prompt(llm: LLM, prompt_ids: Prompts,
                                                     reference: Outputs) -> None:
    llm.generate(prompt_ids, GREEDY)  # whatever ran before, the prompts are cached now
    before = llm.scheduler.engine_stats()["prefill_tokens"]
    again = llm.generate(prompt_ids, GREEDY)
    assert llm.scheduler.engine_stats()["prefill_tokens"] - before == len(prompt_ids)
    assert token_ids(again) == token_ids(reference)
    # Everything but the last prompt token came from the cache (one token must run to sample).
    assert [o["usage"]["cached_tokens"] for o in again] == [len(p) - 1 for p in prompt_ids]
    assert_no_leak(llm)


SYSTEM = ("You are a helpful assistant. Answer the question below with care, citing the "
          "documentation of the standard library where it helps, and keep it short.\n")
QUESTIONS = ("What does textwrap do?", "Explain difflib, please.", "Is typing useful?",
             "How do threads share data?")


@pytest.mark.timeout(180)
def test_shared_system_prompt_is_computed_once(llm: LLM, tiny_model_dir: Path) -> None:
    system, questions = llm.encode(SYSTEM), [llm.encode(q) for q in QUESTIONS]
    prompts = [system + q for q in questions]
    llm.scheduler.flush_cache()
    before = llm.scheduler.engine_stats()["prefill_tokens"]
    # The first request fills the cache; the others arrive while it is there.
    outputs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
    computed = llm.scheduler.engine_stats()["prefill_tokens"] - before
    assert computed <= len(system) + sum(len(q) for q in questions), (
        f"computed {computed} prefill tokens for a {len(system)}-token shared prompt and "
        f"questions of {[len(q) for q in questions]} tokens")
    assert all(o["usage"]["cached_tokens"] >= len(system) for o in outputs[1:])

    naive = make_llm(tiny_model_dir, cache_type="naive")
    expected = naive.generate(prompts, GREEDY)
    assert token_ids(outputs) == token_ids(expected)
    assert naive.scheduler.engine_stats()["prefill_tokens"] == sum(len(p) for p in prompts)
    assert all(o["usage"]["cached_tokens"] == 0 for o in expected)
    assert_no_leak(llm)
    assert_no_leak(naive)


@pytest.mark.timeout(120)
def test_shared_system_prompt_is_computed_once_when_requests_arrive_together(llm: LLM) -> None:
    system, questions = llm.encode(SYSTEM), [llm.encode(q) for q in QUESTIONS]
    llm.scheduler.flush_cache()
    before = llm.scheduler.engine_stats()["prefill_tokens"]
    llm.generate([system + q for q in questions], GREEDY)
    computed = llm.scheduler.engine_stats()["prefill_tokens"] - before
    assert computed <= len(system) + sum(len(q) for q in questions), f"computed {computed}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page_size", [1, 4])
def test_small_pool_retracts_without_changing_outputs(tiny_model_dir: Path, prompt_ids: Prompts,
                                                      reference: Outputs, page_size: int) -> None:
    longest = max(len(p) for p in prompt_ids) + MAX_TOKENS
    num_pages = -(-longest // page_size) + 2  # room for the longest request, little more
    small = make_llm(tiny_model_dir, page_size=page_size, num_pages=num_pages)
    outputs = small.generate(prompt_ids, GREEDY)
    stats = small.scheduler.engine_stats()
    assert stats["retractions"] > 0, f"a {num_pages * page_size}-token pool did not force retraction"
    assert token_ids(outputs) == token_ids(reference)
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert_no_leak(small)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", [
    {"max_prefill_tokens": 16},
    {"page_size": 16},
    {"mixed_batch": False},
    {"page_size": 4, "max_prefill_tokens": 16, "schedule_policy": "fcfs"},
    {"max_running_requests": 3},
    {"cache_type": "naive", "page_size": 4},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_scheduling_choices_keep_outputs(tiny_model_dir: Path, prompt_ids: Prompts,
                                         reference: Outputs, config: dict[str, Any]) -> None:
    other = make_llm(tiny_model_dir, **config)
    outputs = other.generate(prompt_ids, GREEDY)
    assert token_ids(outputs) == token_ids(reference)
    if config.get("max_prefill_tokens") == 16:
        # The 120-token prompt needed 8 chunks, so prefill took many steps.
        assert other.scheduler.engine_stats()["steps"] >= MAX_TOKENS + 8
    assert_no_leak(other)


@pytest.mark.timeout(180)
def test_bfloat16_kv_cache_halves_the_pool_and_follows_transformers(tiny_model_dir: Path, llm: LLM,
                                                                    prompt_ids: Prompts) -> None:
    """--kv-cache-dtype bfloat16 on a float32 model: half the pool bytes, and greedy tokens still
    a best choice of transformers' float32 logits within bfloat16 rounding (2^-8 of logits of
    ~30 here; measured worst gap 0.015)."""
    small = make_llm(tiny_model_dir, kv_cache_dtype="bfloat16")
    runner = small.scheduler.runner
    assert runner.pool.k.dtype == runner.pool.v.dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.pool.nbytes * 2 == llm.scheduler.runner.pool.nbytes
    outs = small.generate(prompt_ids, GREEDY)
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(prompt_ids, outs):
        assert len(out["token_ids"]) == MAX_TOKENS
        check_teacher_forced(hf, prompt, out["token_ids"], tol=0.1)
    assert_no_leak(small)


def test_a_tokenizers_output_is_a_prompt(tiny_model_dir) -> None:
    # transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding, not a list.
    llm = LLM(str(tiny_model_dir), num_pages=64)
    enc = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                            add_generation_prompt=True)
    ids = list(enc["input_ids"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert llm.generate(enc, params)[0]["token_ids"] == llm.generate(ids, params)[0]["token_ids"]
    llm.shutdown()
