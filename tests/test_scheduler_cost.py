"""What a step costs the scheduler, and how much prompt a step may prefill beside decodes.

A long waiting queue that cannot be admitted costs the running requests nothing (the queue is
not looked at); admission takes requests from the queue's front without scanning it; decode
slots are reserved for the whole batch at once. While requests decode, a prompt is prefilled in
chunks sized by MixedPrefillBudget, so no step is many decode steps long."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_reference import torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.scheduler import admission as scheduler_module
from minisgl_mp.scheduler.prefill_budget import MixedPrefillBudget

CPU = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


# ---- MixedPrefillBudget ---------------------------------------------------------------------
def test_budget_is_the_whole_budget_until_it_has_measured_and_without_decodes() -> None:
    b = MixedPrefillBudget(2.0, max_tokens=8192)
    assert b.tokens(0) == b.tokens(16) == 8192  # nothing measured yet
    b.observe(1.0, num_decodes=0, prefill_tokens=1000)  # a prefill alone: 1 ms a token
    assert b.tokens(16) == 8192  # no decode-only step seen yet
    b.observe(0.1, num_decodes=16, prefill_tokens=0)  # a decode step: 100 ms
    assert b.tokens(0) == 8192  # nobody decoding: nobody waits on the step
    assert b.tokens(16) == 100  # (2 - 1) x 100 ms at 1 ms a token


def test_budget_follows_the_ratio_and_its_bounds() -> None:
    b = MixedPrefillBudget(3.0, max_tokens=150)
    b.observe(0.1, 0, 1000)  # 0.1 ms a token
    b.observe(0.01, 4, 0)  # 10 ms decode step
    assert b.tokens(4) == 150  # 200 tokens allowed, capped by max_tokens
    slow = MixedPrefillBudget(2.0, max_tokens=8192)
    slow.observe(1.0, 0, 10)  # 100 ms a token
    slow.observe(0.05, 1, 0)
    assert slow.tokens(1) == 32  # never below the floor: a prompt always advances
    assert MixedPrefillBudget(2.0, max_tokens=16).tokens(1) == 16  # the floor is capped too
    off = MixedPrefillBudget(0.0, max_tokens=8192)
    off.observe(1.0, 0, 10)
    off.observe(0.05, 1, 0)
    assert not off.enabled and off.tokens(1) == 8192


def test_mixed_steps_measure_the_prompt_tokens_beyond_the_decode_step() -> None:
    b = MixedPrefillBudget(2.0, max_tokens=8192)
    b.observe(0.02, 8, 0)  # decode step: 20 ms
    b.observe(0.12, 8, 100)  # + 100 prompt tokens: 100 ms more, 1 ms each
    assert b.token_s == pytest.approx(0.001)
    assert b.tokens(8) == 32  # 20 ms allowed: 20 tokens, raised to the floor


def test_the_decode_step_grows_with_the_batch_beyond_the_batches_seen() -> None:
    """Under load the decode-only steps seen are the early small ones: the budget of a later,
    larger batch uses the line through them, not their average."""
    b = MixedPrefillBudget(2.0, max_tokens=8192)
    for batch in (1, 2, 4, 8):
        b.observe(0.002 + 0.001 * batch, batch, 0)  # 2 ms + 1 ms per request
    b.observe(0.1, 0, 1000)  # 0.1 ms a prompt token
    assert b.decode_step_s(32) == pytest.approx(0.034)
    assert b.tokens(32) in (339, 340)  # (2 - 1) x 34 ms at 0.1 ms a token (floored)
    flat = MixedPrefillBudget(2.0, max_tokens=8192)
    for t in (0.011, 0.009, 0.010):
        flat.observe(t, 4, 0)  # one batch size only: its mean, flat
    assert flat.decode_step_s(4) == flat.decode_step_s(64) == pytest.approx(0.010)


def test_engine_config_refuses_a_ratio_that_bounds_nothing(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="mixed_step_ratio"):
        LLM(str(tiny_model_dir), **CPU, mixed_step_ratio=0.5)


# ---- the scheduler --------------------------------------------------------------------------
def _steps_with_prefill(llm: LLM) -> list[tuple[int, int]]:
    """Wrap the runner: record (decodes, prefill tokens) of every forward."""
    seen: list[tuple[int, int]] = []
    runner = llm.scheduler.runner
    inner = runner.forward

    def forward(layout, *args, **kwargs):  # noqa: ANN001, ANN202 - a pass-through
        prefill = sum(n for n, c in zip(layout.extend_lens, layout.prefix_lens) if n > 1 or c == 0)
        seen.append((len(layout.extend_lens), prefill))
        return inner(layout, *args, **kwargs)

    runner.forward = forward
    return seen


def test_a_prompt_arriving_during_decodes_is_prefilled_within_the_budget(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **CPU, num_pages=2048, max_running_requests=8)
    s = llm.scheduler
    s.prefill_budget.tokens = lambda num_decodes, backlog=0: 40 if num_decodes else 8192  # type: ignore[method-assign]
    seen = _steps_with_prefill(llm)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i in range(4):
        s.add_request(f"d{i}", [10 + i] * 8, params)
    outputs: dict[str, list[int]] = {}
    for out in s.step():  # their prefill, alone: the whole budget
        outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    assert seen[-1][1] == 32
    s.add_request("long", list(range(100, 400)), params)  # 300 tokens, while 4 decode
    while s.has_work:
        for out in s.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    chunked = [p for _, p in seen[1:] if p]
    assert chunked[:7] == [40] * 7 and chunked[7] == 20  # 300 = 7 x 40 + 20, each beside decodes
    assert all(len(v) == 24 for v in outputs.values()) and len(outputs) == 5
    s.check_health()


def test_without_the_budget_the_prompt_goes_in_one_step(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **CPU, num_pages=2048, max_running_requests=8, mixed_step_ratio=0)
    s = llm.scheduler
    seen = _steps_with_prefill(llm)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    s.add_request("d", [7] * 8, params)
    s.step()
    s.add_request("long", list(range(100, 400)), params)
    s.step()
    assert seen[-1] == (2, 300)
    while s.has_work:
        s.step()
    s.check_health()


def test_a_queue_that_cannot_be_admitted_is_not_looked_at(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), **CPU, num_pages=4096, max_running_requests=4)
    s = llm.scheduler
    calls = []
    inner = scheduler_module.order_waiting
    monkeypatch.setattr(scheduler_module, "order_waiting", lambda *a, **k: calls.append(1) or inner(*a, **k))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(300):
        s.add_request(f"r{i}", [1 + i % 50, 2, 3, 4 + i], params)
    s.step()  # admits the first 4
    assert len(s.running) == 4 and len(s.waiting) == 296 and len(calls) == 1
    for _ in range(4):
        s.step()  # decodes with a full house: the queue is not ordered, matched or touched
    assert len(calls) == 1
    finished = []
    while s.has_work:
        finished += [o.rid for o in s.step() if o.finished]
    # fcfs within the lpm fallback for long queues: admitted (and so finished) in arrival order
    # in groups of 4
    assert len(finished) == 300
    assert [int(r[1:]) // 4 for r in finished] == sorted(int(r[1:]) // 4 for r in finished)
    s.check_health()


def test_lpm_aging_counts_rounds_without_touching_each_waiter(tiny_model_dir: Path) -> None:
    """A request queued behind cache-hot ones goes first once it has waited the aging rounds."""
    llm = LLM(str(tiny_model_dir), **CPU, num_pages=4096, max_running_requests=1, schedule_aging_steps=3,
              mixed_step_ratio=0)
    s = llm.scheduler
    hot = list(range(200, 264))
    llm.generate([hot + [1]], SamplingParams(max_tokens=1, temperature=0))  # the hot prefix is cached
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    s.add_request("cold", list(range(500, 520)), params)
    for i in range(6):
        s.add_request(f"hot{i}", hot + [10 + i], params)
    order = []
    while s.has_work:
        s.step()
        order += [r.rid for r in s.running if r.rid not in order]
    # lpm puts hot ones first; the cold one runs after waiting 3 rounds, not last
    assert order[0].startswith("hot") and order.index("cold") < len(order) - 1
    s.check_health()


def test_what_any_prefill_costs_a_step_is_not_charged_to_its_tokens() -> None:
    """A step that carries a prompt pays a fixed extra (the extend path) besides its tokens;
    the budget sees it as such, rather than as a dear token that shrinks the next chunk."""
    b = MixedPrefillBudget(3.0, max_tokens=8192)
    b.observe(0.010, 16, 0)  # decode-only: 10 ms
    for tokens in (32, 64, 128, 64, 32):
        b.observe(0.010 + 0.003 + tokens * 0.00003125, 16, tokens)  # + 3 ms + 1/32 ms a token
    assert b.token_s == pytest.approx(0.00003125)
    assert b.tokens(16) in (543, 544)  # (3 - 1) x 10 ms - 3 ms = 17 ms of tokens


def test_a_backlog_of_prompts_is_let_in_within_a_few_steps() -> None:
    """When prompts arrive faster than the time bound admits them, the bound gives way: the
    queue is cleared in about BACKLOG_STEPS steps rather than growing without limit."""
    from minisgl_mp.scheduler.prefill_budget import BACKLOG_STEPS

    b = MixedPrefillBudget(2.0, max_tokens=8192)
    b.observe(0.05, 0, 100)  # 0.5 ms a token
    b.observe(0.02, 8, 0)  # 20 ms decode step: 40 tokens
    assert b.tokens(8, backlog=200) == 40
    assert b.tokens(8, backlog=4000) == 4000 // BACKLOG_STEPS
    assert b.tokens(8, backlog=10 ** 6) == 8192


def test_a_burst_is_let_in_at_the_rate_of_its_peak_not_geometrically() -> None:
    """The rate a backlog sets holds while it shrinks: a burst is in within about
    BACKLOG_STEPS steps, not an eighth of what is left at each step (which leaves its last
    prompts trickling in at the floor for dozens of steps). An empty backlog resets it."""
    from minisgl_mp.scheduler.prefill_budget import BACKLOG_STEPS

    b = MixedPrefillBudget(2.0, max_tokens=8192)
    b.observe(0.05, 0, 100)  # 0.5 ms a token
    b.observe(0.02, 8, 0)  # 20 ms decode step: 40 tokens by time
    backlog, steps = 4096, 0
    while backlog:
        backlog -= min(backlog, b.tokens(8, backlog))
        steps += 1
    assert steps == BACKLOG_STEPS
    assert b.to_dict()["backlog_drain_tokens"] == 4096 // BACKLOG_STEPS
    assert b.tokens(8, backlog=0) == 40  # the backlog is gone: the time bound again
    assert b.tokens(8, backlog=200) == 40 and b.to_dict()["backlog_drain_tokens"] == 25
    assert b.tokens(8, backlog=8000) == 1000  # a larger backlog raises the rate
