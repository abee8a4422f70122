"""The C kernels for a layer's norm, rotary and SwiGLU steps against the PyTorch path they
replace, and the engine's model with them on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.activation import silu_and_mul
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


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("rows,d", [(1, 8), (3, 1001), (70, 3072)])
def test_silu_mul_matches_torch_as_closely_as_torch_matches_float64(isa: str, rows: int, d: int) -> None:
    """Every vector path (and its scalar tail: d = 1001 leaves a partial vector), over gates
    from far below the exponential's range to far above it."""
    lib = cpu_kernels.load(isa)
    if lib is None:
        pytest.skip("no C compiler")
    g = torch.cat([torch.linspace(-120, 120, 2 * d - 7), torch.tensor([-1e-30, 0.0, 1e-30, -88.5, 88.5, -87.2, 87.9])])
    gate = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(rows))][:d].repeat(rows, 1)
    gate_up = torch.cat([gate * torch.rand(rows, 1), torch.randn(rows, d)], dim=1)
    out = torch.empty(rows, d)
    lib.silu_mul_f32(gate_up.data_ptr(), rows, d, gate_up.stride(0), out.data_ptr())
    ref = silu_and_mul(gate_up.double())
    torch.testing.assert_close(out.double(), ref, rtol=4e-7, atol=1e-30)
    # The Python entry point, on a strided view (rows of the fused projection inside a wider one).
    wide = torch.randn(rows, 2 * d + 5)
    torch.testing.assert_close(cpu_kernels.silu_mul(wide[:, : 2 * d]), silu_and_mul(wide[:, : 2 * d]),
                               rtol=1e-6, atol=1e-7)


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.add_rmsnorm(x.double(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        cpu_kernels.add_rmsnorm(x, torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.qk_norm_rope(torch.zeros(2, 24), 1, 1, 8, None, None, 1e-6, torch.zeros(4, 2, 8),
                                 torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.silu_mul(x.double())


def test_engine_model_gives_the_same_logits_with_and_without_the_kernels(tiny_model_dir: Path) -> None:
    kw = {"device": "cpu", "dtype": "float32", "num_pages": 512, "max_running_requests": 4}
    on, off = LLM(str(tiny_model_dir), **kw), LLM(str(tiny_model_dir), cpu_fused_ops=False, **kw)
    assert all(layer.self_attn.q_norm.cpu_kernels and layer.input_layernorm.cpu_kernels and layer.mlp.cpu_kernels
               for layer in on.scheduler.runner.model.layers)
    assert not any(layer.self_attn.q_norm.cpu_kernels or layer.mlp.cpu_kernels
                   for layer in off.scheduler.runner.model.layers)
    prompts = [list(range(5, 45)), [9, 8, 7]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    outs = [llm.generate(prompts, params) for llm in (on, off)]
    for a, b in zip(*outs):
        assert a["token_ids"] == b["token_ids"]
        got, want = (torch.tensor([lp.token_logprob for lp in o["logprobs"]]) for o in (a, b))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
