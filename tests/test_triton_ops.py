"""The CUDA path's fused element-wise kernels (kernels/triton_ops.py: add+RMSNorm, q/k
norm+RoPE, SiLU-and-mul) against the PyTorch ops they replace, in float32, float16 and
bfloat16, and a model whose layers take them giving the same greedy tokens as one whose layers
do not. They run under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported) when there is no GPU; their speed is for a GPU (launch/gpu_check.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from minisgl_mp import LLM, SamplingParams  # noqa: E402
from minisgl_mp.kernels import triton_ops  # noqa: E402
from minisgl_mp.layers.activation import silu_and_mul  # noqa: E402
from minisgl_mp.layers.mlp import GatedMLP  # noqa: E402
from minisgl_mp.layers.norm import RMSNorm  # noqa: E402
from minisgl_mp.layers.qk_norm_rope import qk_norm_rope  # noqa: E402
from minisgl_mp.layers.rotary import RotaryEmbedding  # noqa: E402
from minisgl_mp.models.config import RopeConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Triton's interpreter converts float32 to bfloat16 by truncation (a GPU rounds to nearest):
# up to a whole step off at each of a kernel's roundings instead of half of one.
TRUNCATES_BF16 = os.environ.get("TRITON_INTERPRET") == "1"


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: to rounding order. 16-bit: within two steps of the dtype at the values' size,
    since the kernels round once where PyTorch's ops round after each (four for bfloat16 under
    the interpreter)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:
        steps = 4 if dtype == torch.bfloat16 and TRUNCATES_BF16 else 2
        step = torch.finfo(dtype).eps * want.float().abs().clamp_min(1.0)
        err = (got.float() - want.float()).abs()
        assert bool((err <= steps * step).all()), f"{dtype}: {float((err / step).max()):.2f} steps off"


def norm_with(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = (torch.rand(dim, generator=gen) + 0.5).to(DEVICE, dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_the_pytorch_ops_and_updates_x_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 64), (5, 96), (2, 3, 200)):  # a row shorter than its power-of-two block, and 3-D
        x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        r = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        norm = norm_with(shape[-1], dtype, gen)
        want_res = x + r
        want = norm(want_res)
        mine = x.clone()
        out, res = triton_ops.add_rmsnorm(mine, r, norm.weight, norm.eps)
        assert res.data_ptr() == mine.data_ptr() and out.shape == x.shape
        close(res, want_res, dtype)
        close(out, want, dtype)
        out, res = triton_ops.add_rmsnorm(x.clone(), None, norm.weight, norm.eps)  # the first layer's
        close(out, norm(x), dtype)
        assert torch.equal(res, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_pytorch_ops(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for shape in ((1, 2 * 64), (3, 2 * 70), (2, 2 * 1500)):  # past one 1,024-channel block
        gate_up = (2 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
        close(triton_ops.silu_mul(gate_up), silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 80])  # 80: a half (40) short of its power-of-two block
def test_qk_norm_rope_matches_the_pytorch_ops(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(2)
    hq, hkv, t = 4, 2, 6
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    q_norm, k_norm = norm_with(head_dim, dtype, gen), norm_with(head_dim, dtype, gen)
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0)).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 100, 511, 3], device=DEVICE)
    q0, k0, v0 = qk_norm_rope(qkv, positions, q_norm, k_norm, rope, hq, hkv, head_dim)
    q1, k1 = triton_ops.qk_norm_rope(qkv, hq, hkv, head_dim, q_norm.weight, k_norm.weight, q_norm.eps,
                                     rope.cos_sin, positions)
    close(q1, q0, dtype)
    close(k1, k0, dtype)
    # Without the norms: the rotation alone, as Llama and Qwen2 take it.
    q2, k2 = rope(positions, qkv[:, : hq * head_dim].reshape(t, hq, head_dim),
                  qkv[:, hq * head_dim : (hq + hkv) * head_dim].reshape(t, hkv, head_dim))
    q3, k3 = triton_ops.qk_norm_rope(qkv, hq, hkv, head_dim, None, None, 0.0, rope.cos_sin, positions)
    close(q3, q2, dtype)
    close(k3, k2, dtype)


def test_the_layers_take_the_kernels_once_enabled_and_give_the_same_values() -> None:
    gen = torch.Generator().manual_seed(3)
    norm = norm_with(64, torch.float32, gen)
    mlp = GatedMLP(64, 96).to(DEVICE)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data = torch.randn(lin.weight.shape, generator=gen).to(DEVICE) * 0.1
    x, r = torch.randn(3, 64, generator=gen).to(DEVICE), torch.randn(3, 64, generator=gen).to(DEVICE)
    want_norm, want_mlp = norm.forward_with_residual(x.clone(), r)[0], mlp(x)
    assert norm.enable_triton_kernels() and mlp.enable_triton_kernels()
    close(norm.forward_with_residual(x.clone(), r)[0], want_norm, torch.float32)
    close(mlp(x), want_mlp, torch.float32)


@pytest.mark.timeout(300)
def test_a_model_on_the_kernels_gives_the_same_greedy_tokens(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU the C kernels and the one-call decode plan come first; both off, the layers run
    # through their modules, which then take the Triton kernels (as on CUDA with --cuda-fused-ops).
    kwargs = {"device": DEVICE.type, "dtype": "float32", "num_pages": 256, "max_running_requests": 4,
              "cpu_fused_ops": False, "cpu_decode_plan": False, "attention_backend": "sdpa"}
    prompts = [[7, 8, 9], list(range(100, 140))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o["token_ids"] for o in LLM(str(tiny_model_dir), **kwargs).generate(prompts, params)]
    llm = LLM(str(tiny_model_dir), **kwargs)
    layers = llm.scheduler.runner.model_config.num_layers
    modules = [m for m in llm.scheduler.runner.model.modules() if hasattr(m, "enable_triton_kernels")]
    # Per layer two norms, the q and k norms and the MLP; and the final norm.
    assert sum(m.enable_triton_kernels() for m in modules) == 5 * layers + 1
    calls = {"add_rmsnorm": 0, "qk_norm_rope": 0, "silu_mul": 0}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(triton_ops, name)):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(triton_ops, name, counted)
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == want
    forwards = calls["silu_mul"] // layers
    assert forwards >= 6 and calls == {"add_rmsnorm": forwards * (2 * layers + 1), "qk_norm_rope": forwards * layers,
                                       "silu_mul": forwards * layers}
