"""Constrained decoding in the engine: the compiled-grammar cache, the token mask (padding rows
of the model's vocabulary included), and a constraint held across chunked prefill, retraction
and abort."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.constrained.base import GrammarBackend, GrammarKey, GrammarMatcher, create_grammar_backend
from minisgl_mp.constrained import base as constrained_base
from minisgl_mp.engine.tokenizer import load_tokenizer

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
WORDS = r"(yes|no|maybe)( (yes|no|maybe)){3,6}"


class CountingBackend(GrammarBackend):
    """Compiles by echoing the key, after `gate` opens; counts compiles."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.gate = threading.Event()
        self.compiled: list[GrammarKey] = []

    def validate(self, key: GrammarKey) -> None:
        if key.spec == "bad":
            raise ValueError("regex is invalid: bad")

    def _compile(self, key: GrammarKey) -> Any:
        self.gate.wait(10)
        self.compiled.append(key)
        if key.spec == "fails":
            raise ValueError("regex cannot be compiled: fails")
        return key.spec

    def matcher(self, compiled: Any) -> GrammarMatcher:
        raise NotImplementedError

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        raise NotImplementedError

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        raise NotImplementedError


def test_cache_compiles_each_key_once_and_keeps_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constrained_base, "MAX_CACHED_GRAMMARS", 2)
    b = CountingBackend()
    a1, a2 = b.compile(GrammarKey("regex", "a")), b.compile(GrammarKey("regex", "a"))
    assert a1 is a2 and not a1.done()  # a second request waits on the same compile
    b.gate.set()
    assert a1.result(5) == "a"
    with pytest.raises(ValueError, match="fails"):
        b.compile(GrammarKey("regex", "fails")).result(5)
    with pytest.raises(ValueError, match="fails"):  # a failure is cached, not recompiled
        b.compile(GrammarKey("regex", "fails")).result(5)
    assert b.compiled == [GrammarKey("regex", "a"), GrammarKey("regex", "fails")]
    assert (b.cache_hits, b.cache_misses) == (2, 2)
    b.compile(GrammarKey("regex", "c")).result(5)  # over the bound: the least recently used goes
    assert b.num_cached == 2
    b.compile(GrammarKey("regex", "a")).result(5)
    assert b.compiled[-1] == GrammarKey("regex", "a")
    b.shutdown()


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> GrammarBackend:
    tok = load_tokenizer(tiny_model_dir)
    b = create_grammar_backend("xgrammar", tok, len(tok) + 100, frozenset([tok.eos_token_id]))
    assert b is not None
    return b


def test_mask_covers_only_constrained_rows_and_never_padding(backend: GrammarBackend, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    vocab = len(tok) + 100  # a model vocabulary padded past the tokenizer's
    m = backend.matcher(backend.compile(GrammarKey("regex", "[0-9]+")).result(30))
    logits = torch.zeros(3, vocab)
    backend.fill_and_apply(logits, [m], [1])
    assert torch.equal(logits[0], torch.zeros(vocab)) and torch.equal(logits[2], torch.zeros(vocab))
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)
    assert torch.isinf(logits[1, len(tok):]).all()  # padding rows: never
    with pytest.raises(ValueError, match="regex is invalid"):
        backend.validate(GrammarKey("regex", "(ab"))
    with pytest.raises(ValueError, match="json_schema is invalid"):
        backend.validate(GrammarKey("json_schema", '{"type": "objekt"}'))


def test_backend_none_and_auto(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    assert create_grammar_backend("none", tok, len(tok), frozenset()) is None
    assert create_grammar_backend("auto", None, 100, frozenset()) is None  # no tokenizer, no grammar


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", num_pages=4096)


def _params(seeds: range) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, temperature=1.0, seed=s, regex=WORDS if s % 2 else PHONE) for s in seeds]


def test_chunked_prefill_and_retraction_keep_the_constraint(tiny_model_dir: Path, reference: LLM) -> None:
    prompts = [reference.encode(f"Question {i}: the answer, in a few words, is") for i in range(4)]
    params = _params(range(4))
    want = reference.generate(prompts, params)
    small = LLM(str(tiny_model_dir), device="cpu", max_prefill_tokens=8, num_pages=1024)  # prompts in chunks
    s = small.scheduler
    for i, (p, sp) in enumerate(zip(prompts, params)):
        s.add_request(f"r{i}", p, sp)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    reasons: dict[str, str | None] = {}

    def step() -> None:
        for o in s.step():
            outs[o.rid] += o.new_token_ids
            if o.finished:
                reasons[o.rid] = o.finish_reason

    while not (len(s.running) == 4 and all(r.output_len >= 3 for r in s.running)):
        step()
    for _ in range(3):  # mid-output, as when the pool runs out: they resume by recomputation
        s._retract_one()
    while s.has_work:
        step()
    assert s.stats.retractions == 3
    for i, (w, p) in enumerate(zip(want, params)):
        assert outs[f"r{i}"] == w["token_ids"]  # seeded: the same tokens however the batch ran
        text = small.tokenizer.decode(outs[f"r{i}"], skip_special_tokens=True)
        assert reasons[f"r{i}"] == "stop" and re.fullmatch(p.regex, text), text


def test_invalid_grammar_and_no_backend_refuse_before_running(reference: LLM,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="regex is invalid"):
        reference.generate("x", SamplingParams(regex="(ab"))
    monkeypatch.setattr(reference.scheduler, "grammar", None)
    with pytest.raises(ValueError, match="--grammar-backend none"):
        reference.generate("x", SamplingParams(regex="a+"))


def test_abort_while_compiling_and_while_running(reference: LLM) -> None:
    s = reference.scheduler
    s.add_request("wait", [1, 2, 3], SamplingParams(max_tokens=8, json_schema='{"type": "array", "maxItems": 1}'))
    assert s.abort("wait") and not s.grammar_queue
    s.add_request("run", [1, 2, 3], SamplingParams(max_tokens=64, ignore_eos=True, regex="[a-z]+"))
    while not any(r.output_len for r in s.running):
        s.step()
    assert s.abort("run")
    while s.has_work:
        s.step()
    s.check_health()
    assert s.engine_stats()["running"] == s.engine_stats()["grammar_waiting"] == 0
