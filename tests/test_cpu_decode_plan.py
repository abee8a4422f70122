"""engine/cpu_decode.py: a step's layers in one C call (kernels/csrc/decode_layers.c).

It must be invisible but for speed: on every step it takes (decodes, prompt chunks, and the
mixed steps of both), its logits are the modules' own, bit for bit (the same kernels in the same
order), for each weight format and KV dtype; steps it does not take (attention outside the C
kernels, rows a product runs elsewhere) and models it does not cover run through the modules;
`--no-cpu-decode-plan` turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.attention.cpu import KERNEL_MAX_QUERY
from minisgl_mp.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: no C kernels")


def _kind(layout) -> str:
    """decode: one token a request; short: every request's new tokens for the paged kernel (at
    most KERNEL_MAX_QUERY); chunk: some prompt chunk for the blocked kernel."""
    lens = layout.extend_lens
    if all(n == 1 for n in lens):
        return "decode"
    return "chunk" if any(n > KERNEL_MAX_QUERY for n in lens) else "short"


def _compare_every_step(llm: LLM) -> dict[str, dict[str, int]]:
    """Run each step twice, modules first, and record per kind of step whether the plan took it
    and whether its logits equal the modules'; the plan's result (not the modules') goes on."""
    runner = llm.scheduler.runner
    plan, forward = runner.cpu_decode, runner.forward
    counts: dict[str, dict[str, int]] = {}
    ran = []

    def counted(x, positions, attn):
        out = plan(x, positions, attn)
        ran.append(out is not None)
        return out

    def both(layout, input_ids, positions, logits_indices):
        runner.model.layer_runner = None
        ref = forward(layout, input_ids, positions, logits_indices)
        runner.model.layer_runner = counted
        out = forward(layout, input_ids, positions, logits_indices)
        c = counts.setdefault(_kind(layout), {"steps": 0, "plan_ran": 0, "mismatches": 0, "beside_decodes": 0})
        c["steps"] += 1
        c["beside_decodes"] += 1 in layout.extend_lens
        c["plan_ran"] += ran[-1]
        c["mismatches"] += not torch.equal(out, ref)
        return out

    runner.forward = both
    return counts


def _staggered(llm: LLM, prompts: dict[str, int], max_tokens: int = 6) -> None:
    """Each prompt (name: length) arrives two steps after the one before, so that later prompts
    are prefilled beside the earlier ones' decodes (mixed steps)."""
    sched = llm.scheduler
    for i, (name, n) in enumerate(prompts.items()):
        sched.add_request(name, [5 + (7 * i + j) % 200 for j in range(n)],
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for _ in range(2):
            sched.step()
    while sched.has_work:
        sched.step()


@pytest.mark.parametrize("kw", [{}, {"quantization": "int8"}, {"quantization": "int4"}, {"dtype": "float16"},
                                {"dtype": "bfloat16"}, {"kv_cache_dtype": "bfloat16"}, {"page_size": 4}],
                         ids=["float32", "int8", "int4", "float16", "bfloat16", "bf16-kv", "page-4"])
def test_plan_logits_are_the_modules_own(tiny_model_dir: Path, kw: dict) -> None:
    llm = LLM(str(tiny_model_dir), num_pages=256, **kw)
    assert llm.scheduler.runner.cpu_decode is not None
    counts = _compare_every_step(llm)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 5, 7)]
    outs = llm.generate(prompts, params)
    assert [len(o["token_ids"]) for o in outs] == [9, 5, 7]
    # Batches of 3, 2 and 1 decodes, all through the plan, all equal to the modules.
    dec = counts["decode"]
    assert dec["steps"] >= 6 and dec["plan_ran"] == dec["steps"] and dec["mismatches"] == 0
    # Prompts arriving while others decode: mixed steps with a 3-token extend (the paged
    # kernel) and with 17- and 40-token chunks (the blocked kernel), taken too but for the
    # chunks beside a bfloat16 pool, which go to sdpa.
    _staggered(llm, {"a": 40, "b": 3, "c": 17, "d": 40})
    assert counts["short"]["beside_decodes"] >= 1 and counts["chunk"]["beside_decodes"] >= 2
    for kind in ("short", "chunk"):
        c = counts[kind]
        assert c["mismatches"] == 0
        assert c["plan_ran"] == (0 if kind == "chunk" and kw.get("kv_cache_dtype") else c["steps"]), (kind, c)
    llm.shutdown()


def test_prompt_chunks_past_a_products_row_limit_run_through_the_modules(tiny_model_dir: Path) -> None:
    # Stored int8 weights widened by the C product run it below DENSE_MIN_ROWS rows, and float32
    # panels beside oneDNN's copy (--cpu-prepack) up to PANELS_MAX_ROWS: a 300-token prompt goes
    # to the modules there; with the default float32 panels, or int8 on AVX512-VNNI (every row
    # count), the plan takes it.
    cases = [({"quantization": "int8", "cpu_vnni": False}, False), ({"cpu_prepack": True}, False), ({}, True)]
    if cpu_kernels.vnni_ready():
        cases.append(({"quantization": "int8"}, True))
    for kw, taken in cases:
        llm = LLM(str(tiny_model_dir), num_pages=512, **kw)
        counts = _compare_every_step(llm)
        _staggered(llm, {"long": 300, "short": 20}, max_tokens=3)
        alone, beside = counts["chunk"]["steps"] - counts["chunk"]["beside_decodes"], counts["chunk"]["beside_decodes"]
        assert alone == 1 and beside >= 1  # the 300-token prompt, then the 20-token one beside its decode
        assert counts["chunk"]["plan_ran"] == beside + int(taken), kw
        assert all(c["mismatches"] == 0 for c in counts.values())
        llm.shutdown()


def test_steps_and_models_it_does_not_take_run_through_the_modules(tiny_model_dir: Path, make_checkpoint) -> None:
    off = LLM(str(tiny_model_dir), num_pages=128, cpu_decode_plan=False)
    assert off.scheduler.runner.cpu_decode is None and off.scheduler.runner.model.layer_runner is None
    off.shutdown()
    moe = LLM(str(make_checkpoint(arch="qwen3_moe")), num_pages=128)
    assert moe.scheduler.runner.cpu_decode is None  # its experts run through the modules
    moe.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plan_takes_llama_and_qwen2_layers_bit_for_bit(make_checkpoint, arch: str) -> None:
    # Llama's attention has no q/k norms; Qwen2's adds q/k/v biases: the C loop rotates
    # without norms and its products add the biases, as the modules do.
    llm = LLM(str(make_checkpoint(arch=arch)), num_pages=256)
    assert llm.scheduler.runner.cpu_decode is not None
    counts = _compare_every_step(llm)
    _staggered(llm, {"a": 40, "b": 3, "c": 17})
    assert counts["decode"]["steps"] >= 4
    for kind in ("decode", "short", "chunk"):
        c = counts[kind]
        assert c["plan_ran"] == c["steps"] and c["mismatches"] == 0, (kind, c)
    llm.shutdown()
