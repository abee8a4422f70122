"""The offline engine at its edges (issue 13): a failure that belongs to one request fails only
that request; every page size works with any context length, up to the limit; sampling
parameters at their extremes run or are refused with a message; stop tokens leave no text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.scheduler.sampler import Sampler

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 301, 302, 303, 304], [40, 41]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_pages=8192)


def assert_whole(llm: LLM) -> None:
    s = llm.scheduler
    assert not s.running and not s.waiting
    s.check_health(full=True)
    stats = s.engine_stats()
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["total_tokens"], stats


def test_a_failure_in_one_requests_sampling_fails_only_that_request(llm: LLM, monkeypatch: Any) -> None:
    ref = llm.generate(PROMPTS, GREEDY)
    bad = SamplingParams(max_tokens=6, temperature=0.7, seed=123, ignore_eos=True)
    real = Sampler.sample

    def sample(self: Sampler, logits: torch.Tensor, reqs: list[Any]) -> Any:
        if any(r.params.seed == 123 for r in reqs):  # this request's constraints "break" sampling
            raise RuntimeError("a constraint of request 123 failed")
        return real(self, logits, reqs)

    monkeypatch.setattr(Sampler, "sample", sample)
    out = llm.generate(PROMPTS + [[70, 71, 72]], [GREEDY] * len(PROMPTS) + [bad])
    assert [o["token_ids"] for o in out[:-1]] == [o["token_ids"] for o in ref]
    assert out[-1]["finish_reason"] == "error" and "request 123 failed" in out[-1]["error"]
    assert_whole(llm)
    assert llm.scheduler.engine_stats()["failed_steps"] == 0  # nothing failed step-wide


def test_a_failure_in_one_requests_stop_check_fails_only_that_request(llm: LLM) -> None:
    class BrokenChecker:
        matched_stop = None

        def push(self, _ids: Any) -> None:
            raise UnicodeError("this request's stop check broke")

    ref = llm.generate(PROMPTS, GREEDY)
    real = llm.scheduler.make_stop_checker
    llm.scheduler.make_stop_checker = lambda req: BrokenChecker() if "zz" in req.params.stop else real(req)
    try:
        out = llm.generate(PROMPTS + [[70, 71]], [GREEDY] * len(PROMPTS)
                           + [SamplingParams(max_tokens=6, temperature=0, stop=["zz"])])
    finally:
        llm.scheduler.make_stop_checker = real
    assert [o["token_ids"] for o in out[:-1]] == [o["token_ids"] for o in ref]
    assert out[-1]["finish_reason"] == "error" and "stop check broke" in out[-1]["error"]
    assert_whole(llm)


def test_out_of_vocabulary_stop_ids_are_refused_naming_the_field(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, min_tokens=1, ignore_eos=True, stop_token_ids=[99999999])
    with pytest.raises(ValueError, match="stop_token_ids: token id 99999999 is outside the vocabulary"):
        llm.generate([[1, 2, 3]], params)
    assert_whole(llm)
    # In range but past the tokenizer's own vocabulary: runs, the id simply never comes.
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True,
                                                  stop_token_ids=[llm.scheduler.sampler.vocab_size - 1]))
    assert len(out[0]["token_ids"]) == 4


EXTREMES = [
    dict(temperature=1e-6), dict(temperature=1e6), dict(top_p=1e-9), dict(top_k=1),
    dict(top_k=1, temperature=5.0), dict(min_p=1.0), dict(repetition_penalty=1e-9),
    dict(repetition_penalty=2.0), dict(presence_penalty=2.0, frequency_penalty=2.0),
    dict(presence_penalty=-2.0, frequency_penalty=-2.0), dict(seed=2**63 - 1), dict(seed=0),
    dict(temperature=0.9, top_p=0.5, top_k=3, min_p=0.2, repetition_penalty=1.7, seed=7),
]


@pytest.mark.parametrize("extra", EXTREMES, ids=[",".join(f"{k}={v}" for k, v in e.items()) for e in EXTREMES])
def test_sampling_extremes_run(llm: LLM, extra: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, **extra)
    out = llm.generate(PROMPTS, params)
    vocab = llm.scheduler.sampler.vocab_size
    for o in out:
        assert o["finish_reason"] == "length" and len(o["token_ids"]) == 5, o
        assert all(0 <= t < vocab for t in o["token_ids"])
    assert_whole(llm)


def test_min_tokens_equal_to_max_tokens_with_likely_stop_ids(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, GREEDY)
    # Every token greedy decoding would pick is a stop id, yet min_tokens holds them off.
    stops = sorted({t for o in greedy for t in o["token_ids"]})[:64]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=stops))
    for o in out:
        assert len(o["token_ids"]) == 6 and o["finish_reason"] == "length", o
        assert not set(o["token_ids"][:5]) & set(stops)
    assert_whole(llm)


@pytest.mark.parametrize("page_size, context_length", [(1, 61), (16, 1000), (16, 77), (64, 130), (64, 65)])
def test_any_page_size_with_any_context_length_runs_to_the_limit(tiny_model_dir: Path, page_size: int,
                                                                context_length: int) -> None:
    llm = LLM(str(tiny_model_dir), page_size=page_size, context_length=context_length,
              num_pages=4 * (-(-context_length // page_size)) + 8, max_running_requests=4)
    # Up to the limit from far (short contexts), from just short of the last page boundary,
    # and with room for one token only.
    prompts = [list(range(100, 100 + context_length - 1)), [7] * (context_length - 20)]
    if context_length < 200:
        prompts.append([3, 4, 5])
    out = llm.generate(prompts, SamplingParams(max_tokens=context_length, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, out):
        assert o["finish_reason"] == "length"
        assert len(p) + len(o["token_ids"]) == context_length, (len(p), len(o["token_ids"]))
    # Again, from the prefix cache.
    again = llm.generate(prompts, SamplingParams(max_tokens=context_length, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in out]
    assert_whole(llm)


def test_a_stop_token_leaves_no_text(llm: LLM) -> None:
    tok = llm.tokenizer
    free = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    ids = free["token_ids"]
    stop_id = ids[3]
    k = ids.index(stop_id)  # its first occurrence
    params = dict(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(**params))[0]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == stop_id
    assert out["token_ids"] == ids[: k + 1]  # the token is among the ids (and counted) ...
    assert out["text"] == tok.decode(ids[:k], skip_special_tokens=True)  # ... but not in the text
    kept = llm.generate([[5, 6, 7, 8]], SamplingParams(**params, include_stop_str_in_output=True))[0]
    assert kept["text"] == tok.decode(ids[: k + 1], skip_special_tokens=True)


def test_eos_text_is_dropped_even_when_special_tokens_are_shown(llm: LLM) -> None:
    """An output that ends on EOS with skip_special_tokens=false: the detokenizer (process and
    offline alike, through visible_ids) shows the text before EOS, not EOS's own."""
    from minisgl_mp.detokenizer.incremental import IncrementalDetokenizer, visible_ids

    tok = llm.tokenizer
    eos = tok.eos_token_id
    ids = [300, 301, 302, eos]
    for include, want in ((False, ids[:-1]), (True, ids)):
        d = IncrementalDetokenizer(tok, skip_special_tokens=False, include_stop=include)
        d.push(visible_ids(ids[:2], False, None, include))
        d.push(visible_ids(ids[2:], True, eos, include))
        d.finish()
        assert d.text == tok.decode(want, skip_special_tokens=False)
    assert tok.decode([eos], skip_special_tokens=False) != ""  # so the check above means something


def test_stop_strings_are_trimmed_unless_kept(llm: LLM) -> None:
    free = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop]))[0]
    kept = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True))[0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_a_device_error_is_fatal_and_a_memory_error_is_not(tiny_model_dir: Path, monkeypatch: Any) -> None:
    """After CUDA's sticky errors the device cannot be trusted: the scheduler stops (the process
    exits naming it). Running out of memory only fails the batch."""
    from minisgl_mp.scheduler.scheduler import FatalSchedulerError

    llm = LLM(str(tiny_model_dir), num_pages=1024)
    real = llm.scheduler.runner.forward
    errors = iter([MemoryError("the CPU attention kernel could not allocate its scratch space"),
                   RuntimeError("CUDA error: an illegal memory access was encountered")])

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise next(errors)

    monkeypatch.setattr(llm.scheduler.runner, "forward", forward)
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert out["finish_reason"] == "error" and "MemoryError" in out["error"]
    assert_whole(llm)
    llm.scheduler.add_request("r", [5, 6, 7], GREEDY)
    with pytest.raises(FatalSchedulerError, match="unrecoverable device error: RuntimeError: CUDA error"):
        llm.scheduler.step()
    monkeypatch.setattr(llm.scheduler.runner, "forward", real)
