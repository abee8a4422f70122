"""engine/cpu_decode.py: a decode step's layers in one C call (kernels/csrc/decode_layers.c).

It must be invisible but for speed: on every decode step it takes, its logits are the
modules' own, bit for bit (the same kernels in the same order), for each weight format and KV
dtype; steps it does not take (prefills, mixed steps) and models it does not cover run through
the modules; `--no-cpu-decode-plan` turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.attention.base import ForwardMode
from minisgl_mp.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no C kernels")


def _compare_every_decode(llm: LLM) -> dict[str, int]:
    """Run each decode step twice, modules first, and record whether the plan's logits equal
    theirs; the plan's result (not the modules') goes on."""
    runner = llm.scheduler.runner
    plan, forward = runner.cpu_decode, runner.forward
    counts = {"decode_steps": 0, "plan_ran": 0, "mismatches": 0}
    ran = []

    def counted(x, positions, attn):
        out = plan(x, positions, attn)
        ran.append(out is not None)
        return out

    def both(layout, input_ids, positions, logits_indices):
        if layout.mode != ForwardMode.DECODE:
            runner.model.layer_runner = counted
            return forward(layout, input_ids, positions, logits_indices)
        runner.model.layer_runner = None
        ref = forward(layout, input_ids, positions, logits_indices)
        runner.model.layer_runner = counted
        out = forward(layout, input_ids, positions, logits_indices)
        counts["decode_steps"] += 1
        counts["plan_ran"] += ran[-1]
        counts["mismatches"] += not torch.equal(out, ref)
        return out

    runner.forward = both
    return counts


@pytest.mark.parametrize("kw", [{}, {"quantization": "int8"}, {"dtype": "float16"}, {"dtype": "bfloat16"},
                                {"kv_cache_dtype": "bfloat16"}, {"page_size": 4}],
                         ids=["float32", "int8", "float16", "bfloat16", "bf16-kv", "page-4"])
def test_plan_logits_are_the_modules_own(tiny_model_dir: Path, kw: dict) -> None:
    llm = LLM(str(tiny_model_dir), num_pages=256, **kw)
    assert llm.scheduler.runner.cpu_decode is not None
    counts = _compare_every_decode(llm)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 5, 7)]
    outs = llm.generate(prompts, params)
    assert [len(o["token_ids"]) for o in outs] == [9, 5, 7]
    # Batches of 3, 2 and 1 decodes, all through the plan, all equal to the modules.
    assert counts["decode_steps"] >= 6 and counts["plan_ran"] == counts["decode_steps"]
    assert counts["mismatches"] == 0
    llm.shutdown()


def test_steps_and_models_it_does_not_take_run_through_the_modules(tiny_model_dir: Path, make_checkpoint) -> None:
    off = LLM(str(tiny_model_dir), num_pages=128, cpu_decode_plan=False)
    assert off.scheduler.runner.cpu_decode is None and off.scheduler.runner.model.layer_runner is None
    off.shutdown()
    llama = LLM(str(make_checkpoint(arch="llama")), num_pages=128)
    assert llama.scheduler.runner.cpu_decode is None  # its rotary runs in PyTorch: no C loop for it
    llama.shutdown()
    # A prompt arriving while others decode makes a mixed step: the plan declines it (the
    # modules run it), and the decode-only steps around it still go through the plan.
    llm = LLM(str(tiny_model_dir), num_pages=256)
    sched = llm.scheduler
    plan = sched.runner.cpu_decode
    taken = []
    sched.runner.model.layer_runner = lambda *a: taken.append(plan(*a)) or taken[-1]
    sched.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        sched.step()
    sched.add_request("b", list(range(30, 50)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while sched.has_work:
        sched.step()
    assert None in taken and any(t is not None for t in taken)
    llm.shutdown()
