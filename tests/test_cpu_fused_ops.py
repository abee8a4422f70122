"""The C kernels for a layer's norm and rotary steps against the PyTorch path they replace, and
the engine's model with them on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.layers.rotary import RotaryEmbedding
from minisgl_mp.models.config import RopeConfig

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the kernels cannot be built")


@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 1024), (70, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_the_torch_norm(rows: int, dim: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=gen)
    x = torch.randn(rows, dim, generator=gen) * 4
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    want, want_res = norm.forward_with_residual(x.clone(), residual)
    assert norm.enable_cpu_kernels()
    x_in = x.clone()
    got, got_res = norm.forward_with_residual(x_in, residual)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
    assert got_res.data_ptr() == x_in.data_ptr(), "the new residual is x, updated in place"


@pytest.mark.parametrize("rope", [RopeConfig(theta=1e6),
                                  RopeConfig(theta=1e4, rope_type="yarn",
                                             params={"factor": 4.0, "original_max_position_embeddings": 64})])
@pytest.mark.parametrize("hq,hkv,d,norms", [(16, 8, 128, True), (4, 4, 64, False), (6, 2, 32, True)])
def test_qk_norm_rope_matches_norm_then_rotary(rope: RopeConfig, hq: int, hkv: int, d: int, norms: bool) -> None:
    gen = torch.Generator().manual_seed(hq * d)
    t, max_pos = 9, 512
    rotary = RotaryEmbedding(d, max_pos, rope)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3
    positions = torch.randint(max_pos, (t,), generator=gen)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
    if norms:
        q, k = q_norm(q), k_norm(k)
    want_q, want_k = rotary(positions, q, k)
    got_q, got_k = cpu_kernels.qk_norm_rope(qkv, hq, hkv, d, q_norm.weight if norms else None,
                                            k_norm.weight if norms else None, 1e-6, rotary.cos_sin, positions)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.add_rmsnorm(x.double(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        cpu_kernels.add_rmsnorm(x, torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.qk_norm_rope(torch.zeros(2, 24), 1, 1, 8, None, None, 1e-6, torch.zeros(4, 2, 8),
                                 torch.zeros(2, dtype=torch.int32))


def test_engine_model_gives_the_same_logits_with_and_without_the_kernels(tiny_model_dir: Path) -> None:
    kw = {"device": "cpu", "dtype": "float32", "num_pages": 512, "max_running_requests": 4}
    on, off = LLM(str(tiny_model_dir), **kw), LLM(str(tiny_model_dir), cpu_fused_ops=False, **kw)
    assert all(layer.self_attn.q_norm.cpu_kernels and layer.input_layernorm.cpu_kernels
               for layer in on.scheduler.runner.model.layers)
    assert not any(layer.self_attn.q_norm.cpu_kernels for layer in off.scheduler.runner.model.layers)
    prompts = [list(range(5, 45)), [9, 8, 7]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    outs = [llm.generate(prompts, params) for llm in (on, off)]
    for a, b in zip(*outs):
        assert a["token_ids"] == b["token_ids"]
        got, want = (torch.tensor([lp.token_logprob for lp in o["logprobs"]]) for o in (a, b))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
