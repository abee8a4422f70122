"""Hypothesis drives the real offline engine (issue 13), not a fake: arbitrary schema-valid
sampling parameters, prompts as text or as ids at the vocabulary's edges, page sizes 1, 16 and
64 with a context length that is a multiple of none of them. Every example must run (or be
refused with ValueError before anything runs), keep its length bounds, and leave every KV page
accounted for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl_mp import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)

CONTEXT = 100
PAGE_SIZES = (1, 16, 64)
VOCAB = 8192  # qwen3-tiny's
_ENGINES: dict[int, LLM] = {}


def engine(model: Path, page_size: int) -> LLM:
    if page_size not in _ENGINES:
        # A small pool, so that eviction and retraction happen too.
        _ENGINES[page_size] = LLM(str(model), page_size=page_size, context_length=CONTEXT,
                                  num_pages=-(-6 * CONTEXT // page_size), max_running_requests=4)
    return _ENGINES[page_size]


edge_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, 1, VOCAB - 1, VOCAB - 2, 8000, 8001, 8002]))
prompt = st.one_of(
    st.lists(edge_ids, min_size=1, max_size=CONTEXT + 4),
    st.text(min_size=1, max_size=80),
)
params = st.fixed_dictionaries({
    "max_tokens": st.integers(1, 24),
    "temperature": st.sampled_from([0.0, 1e-6, 0.7, 1.0, 5.0, 1e4]),
    "top_k": st.sampled_from([-1, 1, 2, 50, VOCAB * 2]),
    "top_p": st.sampled_from([1e-9, 0.3, 0.9, 1.0]),
    "min_p": st.sampled_from([0.0, 0.1, 1.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1e-9, 0.5, 1.0, 1.3, 2.0]),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(edge_ids, max_size=8),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
}, optional={"min_tokens_fraction": st.floats(0, 1)})


def make_params(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    d["min_tokens"] = int(d.pop("min_tokens_fraction", 0.0) * d["max_tokens"])
    return SamplingParams(**d)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(page_size=st.sampled_from(PAGE_SIZES), batch=st.lists(st.tuples(prompt, params), min_size=1, max_size=4))
def test_the_real_engine_survives_any_valid_request(tiny_model_dir: Path, page_size: int,
                                                    batch: list[tuple[Any, dict[str, Any]]]) -> None:
    llm = engine(tiny_model_dir, page_size)
    prompts = [p for p, _ in batch]
    sampling = [make_params(d) for _, d in batch]
    lengths = [len(llm.encode(p)) for p in prompts]
    try:
        outs = llm.generate(prompts, sampling)
    except ValueError as e:  # refused before anything ran: only a prompt that cannot fit
        assert max(lengths) >= CONTEXT, e
        assert "context length" in str(e), e
    else:
        for n, p, out in zip(lengths, sampling, outs):
            got = len(out["token_ids"])
            room = min(p.max_tokens, CONTEXT - n)
            assert out["finish_reason"] in ("stop", "length"), out
            assert 1 <= got <= room, (n, p, got)
            if out["finish_reason"] == "length":
                assert got == room, (n, p, got)
            else:
                assert got >= min(p.min_tokens, room), (p, got)
            assert all(0 <= t < VOCAB for t in out["token_ids"])
            if p.logprobs is not None:
                assert len(out["logprobs"]) == got
            assert isinstance(out["text"], str)
    s = llm.scheduler
    assert not s.running and not s.waiting
    s.check_health(full=True)
