"""The offline engine on generated Llama, Qwen2 and Qwen3-MoE checkpoints (float32, CPU), the way
a server runs them: C kernels on, prompts chunked, the radix cache reused. Greedy tokens must be
best choices of transformers' logits (teacher-forced, within 1e-3), and a rerun of the same
prompts must come from the cache with the same tokens. (Logit-level agreement with transformers,
per architecture, is in test_model_vs_hf.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_reference import MakeCheckpoint, check_teacher_forced, load_hf_model, torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.layers.moe import FusedExperts
from minisgl_mp.layers.norm import RMSNorm

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = ["The quick brown fox jumps over the lazy dog",
           "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2,
           "Hello"]
ARCHS = {
    "llama": {"tie_word_embeddings": True},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3_moe": {"mlp_only_layers": [2]},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_engine_greedy_follows_hf_through_chunks_and_the_cache(arch: str, make_checkpoint: MakeCheckpoint) -> None:
    model_dir: Path = make_checkpoint(ARCHS[arch], arch=arch)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_pages=1024, max_running_requests=8,
              max_prefill_tokens=16)
    model = llm.scheduler.runner.model
    assert type(model).__name__ == load_hf_model(model_dir).__class__.__name__
    assert all(m.cpu_kernels for m in model.modules() if isinstance(m, RMSNorm)), "C kernels not on"
    prompts = [llm.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 16, "one prompt must need several prefill chunks"

    first = llm.generate(prompts, GREEDY)
    hf = load_hf_model(model_dir)
    for prompt, out in zip(prompts, first):
        assert len(out["token_ids"]) == GREEDY.max_tokens
        check_teacher_forced(hf, prompt, out["token_ids"])

    again = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
    assert [o["usage"]["cached_tokens"] for o in again] == [len(p) - 1 for p in prompts]
    llm.scheduler.check_health()


def test_moe_experts_are_grouped_not_looped_over_tokens() -> None:
    # Each expert with tokens runs one product per projection, whatever the token count.
    experts = FusedExperts(num_experts=4, hidden_size=8, intermediate_size=6)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(50, 8)
    ids = torch.stack([torch.arange(50) % 3, (torch.arange(50) + 1) % 3], dim=1)  # expert 3 unused
    w = torch.rand(50, 2)
    calls = []
    with _CountLinear(calls):
        y = experts(x, ids, w)
    # 3 experts with tokens x (gate|up, down), each product over all of that expert's 33 or 34
    # tokens; none for the unused expert 3.
    assert sorted(calls) == [33, 33, 33, 33, 34, 34], calls
    ref = torch.zeros_like(x)
    for t in range(50):
        for j in range(2):
            e = int(ids[t, j])
            g, u = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            ref[t] += w[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


class _CountLinear(torch.overrides.TorchFunctionMode):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.nn.functional.linear:
            self.calls.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))
