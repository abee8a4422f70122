"""Requests at the scheduler's edge: aborts free their KV wherever the request is, prompts that
cannot run are refused with a clear ValueError, and the context and pool bound generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_reference import torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.scheduler.scheduler import ReqOutput, Scheduler

GREEDY = SamplingParams(max_tokens=8, temperature=0)
CPU = {"device": "cpu", "dtype": "float32"}
LONG = list(range(1000, 1120))  # 120 tokens: 8 prefill chunks of 16


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), **CPU, num_pages=1024, max_prefill_tokens=16, max_running_requests=8)


@pytest.fixture(scope="module")
def short_llm(tiny_model_dir: Path) -> LLM:
    """Context of 64 tokens, a pool of 96."""
    return LLM(str(tiny_model_dir), **CPU, context_length=64, num_pages=24, page_size=4, max_running_requests=4)


def assert_idle_and_clean(s: Scheduler) -> None:
    s.check_health()
    st = s.engine_stats()
    assert st["running"] == st["waiting"] == 0 and st["protected_tokens"] == 0
    assert st["free_tokens"] + st["evictable_tokens"] == st["total_tokens"], f"KV leaked: {st}"


def run_until_idle(s: Scheduler) -> dict[str, list[ReqOutput]]:
    outputs: dict[str, list[ReqOutput]] = {}
    for _ in range(1000):
        if not s.has_work:
            return outputs
        for out in s.step():
            outputs.setdefault(out.rid, []).append(out)
    raise AssertionError("the scheduler did not go idle")


# ---- abort --------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_abort_of_a_decoding_request_frees_its_kv(llm: LLM) -> None:
    s = llm.scheduler
    s.add_request("long-running", [5, 6, 7, 8], SamplingParams(max_tokens=200, temperature=0))
    s.add_request("neighbour", [9, 10, 11], GREEDY)
    first = [out for _ in range(4) for out in s.step()]
    assert s.engine_stats()["running"] == 2
    assert s.abort("long-running") is True
    s.check_health()
    outputs = run_until_idle(s)
    (aborted,) = outputs["long-running"]
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.new_token_ids == []
    neighbour = [o for o in first if o.rid == "neighbour"] + outputs["neighbour"]
    assert neighbour[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in neighbour) == GREEDY.max_tokens
    assert s.abort("long-running") is False, "a finished request was aborted twice"
    assert_idle_and_clean(s)


@pytest.mark.timeout(120)
def test_abort_in_the_middle_of_a_chunked_prefill(llm: LLM) -> None:
    s = llm.scheduler
    s.add_request("chunked", LONG, GREEDY)
    s.step()
    s.step()
    assert s.engine_stats()["running"] == 1
    assert s.abort("chunked") is True
    s.check_health()
    assert run_until_idle(s)["chunked"][0].finish_reason == "abort"
    assert_idle_and_clean(s)


@pytest.mark.timeout(60)
def test_abort_of_a_waiting_request_and_of_unknown_ids(llm: LLM) -> None:
    s = llm.scheduler
    s.add_request("queued", [1, 2, 3], GREEDY)
    assert s.abort("queued") is True
    assert s.abort("never-added") is False
    outputs = run_until_idle(s)
    assert [o.finish_reason for o in outputs["queued"]] == ["abort"]
    assert_idle_and_clean(s)


@pytest.mark.timeout(60)
def test_request_id_is_reusable_after_abort(llm: LLM) -> None:
    s = llm.scheduler
    s.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        s.add_request("dup", [4, 5], GREEDY)
    s.abort("dup")
    s.add_request("dup", [4, 5], GREEDY)
    assert run_until_idle(s)["dup"][-1].finish_reason == "length"
    assert_idle_and_clean(s)


# ---- prompts that cannot run ------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([8192], r"token id 8192 is outside the vocabulary \[0, 8192\)"),
    ([1, -1, 2], r"token id -1 is outside the vocabulary \[0, 8192\)"),
])
def test_invalid_prompt_is_refused(llm: LLM, prompt: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.scheduler.add_request("bad", prompt, GREEDY)
    assert_idle_and_clean(llm.scheduler)


@pytest.mark.timeout(60)
def test_prompt_filling_the_context_is_refused(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="64 tokens; the context length is 64"):
        short_llm.scheduler.add_request("full", list(range(64)), GREEDY)
    out = short_llm.generate([list(range(63))], GREEDY)[0]
    assert len(out["token_ids"]) == 1 and out["finish_reason"] == "length"


@pytest.mark.timeout(60)
def test_prompt_larger_than_the_pool_is_refused(tiny_model_dir: Path) -> None:
    tiny_pool = LLM(str(tiny_model_dir), **CPU, num_pages=8, page_size=4, max_running_requests=2)
    with pytest.raises(ValueError, match="KV pool holds only 32"):
        tiny_pool.scheduler.add_request("big", list(range(40)), GREEDY)
    out = tiny_pool.generate([list(range(20))], SamplingParams(max_tokens=50, temperature=0))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 12, "the pool bounds the request"


@pytest.mark.timeout(60)
def test_failed_generate_leaves_the_engine_usable(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], []], GREEDY)
    assert_idle_and_clean(llm.scheduler)
    out = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out) == 1 and len(out[0]["token_ids"]) == GREEDY.max_tokens


@pytest.mark.timeout(60)
def test_prompt_and_params_counts_must_match(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate([[1], [2]], [GREEDY] * 3)


# ---- bounds on generation ---------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_context_length_ends_generation_with_length(short_llm: LLM) -> None:
    outputs = short_llm.generate([list(range(50)), list(range(100, 160))],
                                 SamplingParams(max_tokens=100, temperature=0))
    assert [len(o["token_ids"]) for o in outputs] == [14, 4]
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert_idle_and_clean(short_llm.scheduler)


@pytest.mark.timeout(60)
def test_context_length_beyond_the_model_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="context_length 5000 exceeds the model's max_position_embeddings 4096"):
        LLM(str(tiny_model_dir), **CPU, context_length=5000, num_pages=16)


def test_a_context_length_off_the_page_size_runs_to_the_end(tiny_model_dir: Path) -> None:
    """context_length 100 with 16-token pages: the last page (slots 96..111) runs past the
    context; the request still reaches its last token instead of failing the step."""
    small = LLM(str(tiny_model_dir), **CPU, context_length=100, page_size=16, num_pages=64, max_running_requests=2)
    out = small.generate([list(range(5, 90))], SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 15 and out["finish_reason"] == "length"
