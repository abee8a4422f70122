"""Overlap scheduling (`--disable-overlap-schedule`): the scheduler launches step N+1 before it
reads step N's tokens, whose decodes take their input from step N's sampled tokens on the
device. On the CPU the forward runs on the host, so nothing actually overlaps there, but the
lagged bookkeeping is the same code as on a GPU: these tests run it against the plain loop.
What a user sees must not change: the same tokens (greedy, seeded, with penalties, stop tokens
and strings, grammars, retraction), the same usage counts, and no KV leaks, aborts and failed
steps included.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import check_teacher_forced, load_hf_model, torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.engine.builder import build_scheduler
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.scheduler.faults import FaultPlan
from test_engine import assert_no_leak as assert_engine_no_leak

PROMPTS = [[7], [300, 301, 302], list(range(1000, 1090)), [42] * 9, list(range(50, 75)), [5, 6, 7, 8]]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def make_llm(model_dir: Path, overlap: bool, **kwargs: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "num_pages": 2048, "max_running_requests": 16,
                "disable_overlap_schedule": not overlap}
    return LLM(str(model_dir), **(defaults | kwargs))


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, overlap=False)


@pytest.fixture(scope="module")
def overlapped(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, overlap=True)


def assert_no_leak(llm: LLM) -> None:
    assert_engine_no_leak(llm)
    assert llm.scheduler._inflight is None


def strip(outs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(o["token_ids"], o["finish_reason"], o.get("matched_stop"), o.get("usage"), o.get("error"))
            for o in outs]


def test_overlap_is_off_on_the_cpu_by_default_and_can_be_turned_on(tiny_model_dir: Path) -> None:
    base = {"model": str(tiny_model_dir), "device": "cpu", "num_pages": 256}
    assert not build_scheduler(EngineConfig(**base), progress=False)[0].overlap
    assert build_scheduler(EngineConfig(**base, disable_overlap_schedule=False), progress=False)[0].overlap
    assert not build_scheduler(EngineConfig(**base, disable_overlap_schedule=True), progress=False)[0].overlap


@pytest.mark.timeout(180)
def test_greedy_outputs_match_the_plain_loop_and_transformers(tiny_model_dir: Path, plain: LLM,
                                                             overlapped: LLM) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 9, 17, 24, 5)]
    want = plain.generate(PROMPTS, params)
    got = overlapped.generate(PROMPTS, params)
    assert strip(got) == strip(want)
    assert [len(o["token_ids"]) for o in got] == [1, 2, 9, 17, 24, 5]
    assert [o["usage"]["completion_tokens"] for o in got] == [1, 2, 9, 17, 24, 5]
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(PROMPTS, got):
        check_teacher_forced(hf, prompt, out["token_ids"])
    assert_no_leak(overlapped)


def test_a_decode_step_reads_its_input_from_the_step_still_unread(overlapped: LLM) -> None:
    sched = overlapped.scheduler
    sched.add_request("lag", [11, 12, 13], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert sched.step() == []  # the prefill is launched; its token is not read yet
    first = sched._inflight
    assert first is not None and first.batch.sampled_reqs[0].token_ids[-1] == -1  # a placeholder
    outs = sched.step()  # launches the first decode, then reads the prefill's token
    assert sched._inflight.batch.has_futures
    assert [o.rid for o in outs] == ["lag"] and len(outs[0].new_token_ids) == 1
    tokens = list(outs[0].new_token_ids)
    while sched.has_work:
        tokens += [t for o in sched.step() for t in o.new_token_ids]
    ref = overlapped.generate([[11, 12, 13]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert tokens == ref[0]["token_ids"]
    assert_no_leak(overlapped)


@pytest.mark.timeout(120)
def test_stop_tokens_and_strings_end_at_the_same_token(plain: LLM, overlapped: LLM) -> None:
    greedy = plain.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stops = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[o["token_ids"][3]])
             for o in greedy]
    text = greedy[2]["text"]
    stops[2] = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
    want = plain.generate(PROMPTS, stops)
    got = overlapped.generate(PROMPTS, stops)
    assert strip(got) == strip(want)
    assert [o["text"] for o in got] == [o["text"] for o in want]
    assert sum(o["finish_reason"] == "stop" for o in got) >= 5
    # The step launched after a stop token ran the request once more; its KV went back.
    assert_no_leak(overlapped)


@pytest.mark.timeout(120)
def test_no_step_assigns_a_python_scalar_through_indexing(overlapped: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU `t[idx] = False` copies the scalar from pageable memory, which synchronises the
    # stream: the host would wait for the forward that overlap scheduling left running (the page
    # allocator did so every step until the H200 run of docs/benchmarks.md section 29). The
    # CPU cannot see the sync, so this looks for the pattern in every step's code.
    where: dict[str, int] = {}
    setitem = torch.Tensor.__setitem__

    def spy(self: torch.Tensor, index: Any, value: Any) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if isinstance(value, (bool, int, float)) and "minisgl_mp" in caller:
            key = f"{Path(caller).name}:{sys._getframe(1).f_lineno}"
            where[key] = where.get(key, 0) + 1
        setitem(self, index, value)

    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.1, min_tokens=6, logit_bias=((5, 1.0),), stop=["ab"])] * 2
    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    outs = overlapped.generate(PROMPTS, params)
    monkeypatch.undo()
    assert all(o["token_ids"] for o in outs)
    assert where == {}, f"Python scalars assigned through indexing (a sync per call on a GPU): {where}"
    assert_no_leak(overlapped)


@pytest.mark.timeout(180)
def test_seeded_sampling_and_penalties_do_not_change(plain: LLM, overlapped: LLM) -> None:
    params = [
        SamplingParams(max_tokens=12, temperature=2.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.8, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.5, top_k=5, seed=13, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=6, logit_bias=((9, 5.0),)),
    ]
    want = plain.generate(PROMPTS, params)
    got = overlapped.generate(PROMPTS, params)
    assert strip(got) == strip(want)
    assert [[lp.top_ids for lp in o["logprobs"]] for o in got] == [[lp.top_ids for lp in o["logprobs"]] for o in want]
    assert_no_leak(overlapped)


@pytest.mark.timeout(180)
def test_retraction_in_a_small_pool_keeps_outputs(tiny_model_dir: Path, plain: LLM) -> None:
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = plain.generate(prompts, params)
    small = make_llm(tiny_model_dir, overlap=True, num_pages=24, page_size=4)  # room for ~1.4 requests
    got = small.generate(prompts, params)
    assert small.scheduler.stats.retractions > 0, "the pool was meant to run out"
    assert strip(got) == strip(want)
    assert_no_leak(small)


@pytest.mark.timeout(120)
def test_grammar_requests_read_each_token_before_the_next_step(plain: LLM, overlapped: LLM) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=30, temperature=0, json_schema=json.dumps(schema)),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    want = plain.generate([[1, 2, 3], [4, 5, 6]], params)
    got = overlapped.generate([[1, 2, 3], [4, 5, 6]], params)
    assert strip(got) == strip(want)
    assert isinstance(json.loads(got[0]["text"])["a"], int)
    assert_no_leak(overlapped)


@pytest.mark.timeout(120)
def test_abort_while_a_step_is_in_flight(overlapped: LLM) -> None:
    sched = overlapped.scheduler
    for i in range(3):
        sched.add_request(f"ab{i}", [20 + i, 21, 22], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {f"ab{i}": [] for i in range(3)}
    finished: dict[str, str | None] = {}
    for _ in range(4):
        for o in sched.step():
            got[o.rid] += o.new_token_ids
    assert sched._inflight is not None and any(r.rid == "ab1" for r in sched._inflight.batch.reqs)
    assert sched.abort("ab1")
    while sched.has_work:
        for o in sched.step():
            got[o.rid] += o.new_token_ids
            if o.finished:
                finished[o.rid] = o.finish_reason
    assert finished == {"ab0": "length", "ab1": "abort", "ab2": "length"}
    assert len(got["ab0"]) == len(got["ab2"]) == 30 and len(got["ab1"]) < 30
    assert_no_leak(overlapped)


@pytest.mark.timeout(120)
def test_a_failed_step_delivers_the_tokens_of_the_step_before(tiny_model_dir: Path, plain: LLM) -> None:
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", num_pages=512, disable_overlap_schedule=False)
    # Forward 1 is the prefill, 2-3 decodes; forward 4 raises while forward 3's tokens are unread.
    sched, _ = build_scheduler(config, progress=False, faults=FaultPlan.parse("forward@4"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sched.add_request("f", [3, 4, 5], params)
    outs = []
    while sched.has_work:
        outs += sched.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finished and outs[-1].error is not None and "InjectedFault" in outs[-1].error
    assert tokens == plain.generate([[3, 4, 5]], params)[0]["token_ids"][:3]
    sched.check_health()
    # The server goes on: the next request runs to its end.
    sched.add_request("g", [3, 4, 5], params)
    outs = []
    while sched.has_work:
        outs += sched.step()
    assert [t for o in outs for t in o.new_token_ids] == plain.generate([[3, 4, 5]], params)[0]["token_ids"]
