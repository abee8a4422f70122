"""Our models (Qwen3, Llama, Qwen2, Qwen3-MoE) and paged attention against transformers' on the CPU.

Each model runs through the same path the engine uses (`PagedModel`: model + KV pool + page
table + the default attention backend; sdpa too), with every request's KV slots scattered over the pool, so
attention must follow the page table. Logits must agree with HF's for batched prefill, batched
decode over the KV cache, and an extend over a cached prefix: within 1e-5 in float64 (the
math), and in float32 within what float32 rounding allows (see `tolerance`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import (
    MakeCheckpoint,
    PagedModel,
    check_teacher_forced,
    hf_greedy,
    hf_logits,
    load_hf_model,
    torch_threads,
)
from minisgl_mp.attention.base import ForwardMode

# float32: 1e-4 while |logit| <= 30, growing with the logit scale past that. float32 rounding
# alone moves logits in proportion to their size, in HF and in ours alike: on checkpoints with
# |logit| ~50, HF's own float32 logits were 1.2e-4 from its float64 ones, and ours 1.4e-4 from
# HF's. Measured here (|logit| <= 32): at most 7e-5. In float64 both agree to 1e-6 (the rope
# tables are float32 in both).
ATOL = 1e-4
F32_RELATIVE = ATOL / 30
F64_ATOL = 1e-5
PROMPT_LENS = (1, 7, 33, 90)
VOCAB = 8192  # qwen3-tiny's, which every config here keeps

LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
# Name -> (make_model --arch, overrides of configs/models/qwen3-tiny.json: tied, 4 query heads,
# 2 KV heads, head_dim 64).
MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tied-mha-d64": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4, "head_dim": 64}),
    "untied-mqa-d128": ("qwen3", {"tie_word_embeddings": False, "num_key_value_heads": 1, "head_dim": 128}),
    "untied-mha-d128": ("qwen3", {"tie_word_embeddings": False, "num_key_value_heads": 4, "head_dim": 128}),
    "tiny-default": ("qwen3", {}),
    # Llama 3.2-1B's kind: tied, grouped-query, llama3 rope scaling (its original length below
    # the longest prompt, so the scaled frequencies matter).
    "llama-tied-gqa": ("llama", {"tie_word_embeddings": True, **LLAMA3_ROPE}),
    "llama-untied-mqa": ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
    "qwen2-untied-bias": ("qwen2", {"tie_word_embeddings": False}),
    # 8 experts, top 2, renormalised; layer 2 of 4 dense (mlp_only_layers).
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [2]}),
}
ROPE_CONFIGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}},
    # transformers 5's form, theta inside; factor = max_position_embeddings / original, as HF expects.
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 1024}},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _split(logits: torch.Tensor, lens: Sequence[int]) -> list[torch.Tensor]:
    return list(logits.split(list(lens)))


def tolerance(ref: torch.Tensor) -> float:
    if ref.dtype == torch.float64:
        return F64_ATOL
    return max(ATOL, F32_RELATIVE * float(ref.abs().max()))


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != HF's {tuple(ref.shape)}"
    err, tol = float((ours.to(ref.dtype) - ref).abs().max()), tolerance(ref)
    assert err < tol, f"{what}: max |logit - HF logit| {err:.2e} >= {tol:.2e} ({ref.dtype})"


class _Case:
    """A checkpoint with our paged model, HF's model and HF's logits over prompt + 3 tokens."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self.ours = PagedModel.load(model_dir, dtype)
        self.hf = load_hf_model(model_dir, dtype)
        self.prompts = _prompts()
        gen = torch.Generator().manual_seed(2)
        self.next_tokens = torch.randint(0, VOCAB, (3, len(self.prompts)), generator=gen).tolist()
        self.ref = [hf_logits(self.hf, p + [step[i] for step in self.next_tokens])
                    for i, p in enumerate(self.prompts)]


_cases: dict[str, _Case] = {}


def _case(make_checkpoint: MakeCheckpoint, overrides: dict[str, Any],
          dtype: torch.dtype = torch.float32, arch: str = "qwen3") -> _Case:
    key = repr((arch, sorted(overrides.items()), dtype))
    if key not in _cases:
        _cases[key] = _Case(make_checkpoint(overrides, arch=arch), dtype)
    case = _cases[key]
    case.ours.reset()
    return case


@pytest.fixture(params=[(name, dt) for name in MODEL_CONFIGS for dt in ("float32", "float64")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request: pytest.FixtureRequest, make_checkpoint: MakeCheckpoint) -> _Case:
    name, dtype = request.param
    arch, overrides = MODEL_CONFIGS[name]
    return _case(make_checkpoint, overrides, getattr(torch, dtype), arch)


@pytest.mark.timeout(120)
def test_batched_prefill_matches_hf(case: _Case) -> None:
    rows = list(range(len(case.prompts)))
    logits = case.ours.run(ForwardMode.EXTEND, rows, case.prompts)
    for i, (ours, p) in enumerate(zip(_split(logits, PROMPT_LENS), case.prompts)):
        _check(ours, case.ref[i][: len(p)], f"prefill of prompt {i} ({len(p)} tokens)")


@pytest.mark.timeout(120)
def test_logits_indices_pick_the_same_rows(case: _Case) -> None:
    rows = list(range(len(case.prompts)))
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    logits = case.ours.run(ForwardMode.EXTEND, rows, case.prompts, logits_indices=last)
    assert logits.shape == (len(rows), VOCAB)
    for i, p in enumerate(case.prompts):
        _check(logits[i], case.ref[i][len(p) - 1], f"last-token logits of prompt {i}")


@pytest.mark.timeout(120)
def test_batched_decode_over_kv_cache_matches_hf(case: _Case) -> None:
    rows = list(range(len(case.prompts)))
    case.ours.run(ForwardMode.EXTEND, rows, case.prompts)
    for step, tokens in enumerate(case.next_tokens):
        logits = case.ours.run(ForwardMode.DECODE, rows, [[t] for t in tokens])
        for i, p in enumerate(case.prompts):
            _check(logits[i], case.ref[i][len(p) + step], f"decode step {step} after {len(p)} prompt tokens")


@pytest.mark.timeout(120)
def test_chunked_extend_over_cached_prefix_matches_hf(case: _Case) -> None:
    # First chunk: two thirds of each prompt (the 1-token prompt runs whole). Second: the rest
    # plus one more token, in one EXTEND batch whose requests extend by 1 to 31 tokens.
    rows = list(range(len(case.prompts)))
    full = [p + [case.next_tokens[0][i]] for i, p in enumerate(case.prompts)]
    split = [max(1, 2 * len(p) // 3) for p in case.prompts]
    first = case.ours.run(ForwardMode.EXTEND, rows, [f[:s] for f, s in zip(full, split)])
    second = case.ours.run(ForwardMode.EXTEND, rows, [f[s:] for f, s in zip(full, split)])
    rest = [len(f) - s for f, s in zip(full, split)]
    for i, (a, b) in enumerate(zip(_split(first, split), _split(second, rest))):
        ref = case.ref[i][: len(full[i])]
        _check(a, ref[: split[i]], f"request {i}: first {split[i]} tokens")
        _check(b, ref[split[i] :], f"request {i}: {rest[i]} tokens over {split[i]} cached")


@pytest.mark.timeout(120)
def test_sdpa_backend_matches_hf_in_float32(make_checkpoint: MakeCheckpoint) -> None:
    """The default CPU backend sends these short runs to the C kernel; sdpa takes them all."""
    case = _case(make_checkpoint, {})
    case.ours.use_backend("sdpa")
    try:
        rows = list(range(len(case.prompts)))
        full = [p + [case.next_tokens[0][i]] for i, p in enumerate(case.prompts)]
        split = [max(1, 2 * len(p) // 3) for p in case.prompts]
        case.ours.run(ForwardMode.EXTEND, rows, [f[:s] for f, s in zip(full, split)])
        second = case.ours.run(ForwardMode.EXTEND, rows, [f[s:] for f, s in zip(full, split)])
        for i, b in enumerate(_split(second, [len(f) - s for f, s in zip(full, split)])):
            _check(b, case.ref[i][split[i] : len(full[i])], f"request {i}: extend over {split[i]} cached")
        logits = case.ours.run(ForwardMode.DECODE, rows, [[t] for t in case.next_tokens[1]])
        for i, f in enumerate(full):
            _check(logits[i], case.ref[i][len(f)], f"decode after {len(f)} tokens")
    finally:
        case.ours.use_backend("auto")


@pytest.mark.timeout(120)
def test_decode_of_equal_length_requests_matches_hf(make_checkpoint: MakeCheckpoint) -> None:
    # Equal lengths take the unmasked decode path.
    case = _case(make_checkpoint, {})
    prompts = [p[:33] for p in _prompts(seed=3)[2:]]
    case.ours.run(ForwardMode.EXTEND, [0, 1], prompts)
    logits = case.ours.run(ForwardMode.DECODE, [0, 1], [[5], [6]])
    for i, (p, t) in enumerate(zip(prompts, (5, 6))):
        _check(logits[i], hf_logits(case.hf, p + [t])[-1], f"decode of request {i}")


@pytest.mark.timeout(120)
def test_greedy_decode_loop_follows_hf_greedy(make_checkpoint: MakeCheckpoint) -> None:
    case = _case(make_checkpoint, {})
    prompt = case.prompts[2]
    logits = case.ours.run(ForwardMode.EXTEND, [0], [prompt])
    tokens = [int(logits[-1].argmax())]
    for _ in range(15):
        tokens.append(int(case.ours.run(ForwardMode.DECODE, [0], [[tokens[-1]]])[0].argmax()))
    check_teacher_forced(case.hf, prompt, tokens)
    reference = hf_greedy(case.hf, prompt, len(tokens))
    assert tokens == reference, f"ours {tokens}\nHF   {reference}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rope", list(ROPE_CONFIGS))
def test_rope_scaling_matches_hf(rope: str, make_checkpoint: MakeCheckpoint) -> None:
    case = _case(make_checkpoint, {"num_hidden_layers": 2, **ROPE_CONFIGS[rope]})
    rows = list(range(len(case.prompts)))
    prefill = _split(case.ours.run(ForwardMode.EXTEND, rows, case.prompts), PROMPT_LENS)
    decode = case.ours.run(ForwardMode.DECODE, rows, [[t] for t in case.next_tokens[0]])
    for i, p in enumerate(case.prompts):
        _check(prefill[i], case.ref[i][: len(p)], f"{rope}: prefill of prompt {i}")
        _check(decode[i], case.ref[i][len(p)], f"{rope}: decode after prompt {i}")
    # The scaling must matter, or this test would pass with scaling ignored.
    plain = _case(make_checkpoint, {"num_hidden_layers": 2})
    unscaled = plain.ours.run(ForwardMode.EXTEND, [3], [case.prompts[3]])
    assert float((prefill[3] - unscaled).abs().max()) > 1e-2, f"{rope} scaling left the logits unchanged"
