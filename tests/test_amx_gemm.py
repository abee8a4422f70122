"""bfloat16 weights on AMX tiles (kernels/csrc/amx_gemm.c), where the CPU has them.

The kernel against float64 products of the same bfloat16 operands (x rounded to bfloat16 as
the kernel does): every row count that exercises its 32-row blocks, their 16-row halves and its
row chunks, with and without a bias and with strided rows; `Linear` choosing it for bfloat16
weights and only where it fits; the engine's `--no-cpu-amx` giving the widening path. On a CPU
without AMX (or in the `noamx` build) the kernel reports itself unavailable and nothing uses it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.linear import Linear

from attention_cases import extend_case  # noqa: E402

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_ready(), reason="no AMX on this CPU (or no C compiler)")

# (in, out): one 32-channel block; several blocks per thread; K long enough that a row chunk
# of the kernel's bfloat16 copy of x holds fewer rows than some batches below (K 2048: 128).
SHAPES = ((32, 32), (96, 160), (2048, 64))
ROWS = (1, 5, 16, 17, 31, 32, 33, 64, 129, 300)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.to(torch.bfloat16).double() @ w.double().T
    return y if bias is None else y + bias.double()


@needs_amx
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_matches_float64_products_of_its_bfloat16_operands(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        amx = cpu_kernels.AmxWeight(w, b)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            # float32 sums of k products of bfloat16 operands ~1: rounding grows like sqrt(k) * 2^-24.
            torch.testing.assert_close(amx.matmul(x).double(), _reference(x, w, b), atol=2e-4, rtol=1e-5,
                                       msg=f"{rows}x{k} -> {n}, bias {b is not None}")


@needs_amx
def test_kernel_takes_strided_rows_and_rounds_x_to_nearest_even() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    amx = cpu_kernels.AmxWeight(w)
    wide = torch.randn(40, 160, generator=gen)
    x = wide[:, 32:128]  # rows 160 floats apart
    torch.testing.assert_close(amx.matmul(x).double(), _reference(x, w, None), atol=2e-4, rtol=1e-5)
    # A value halfway between two bfloat16 numbers goes to the even one, as torch rounds it.
    half = torch.full((1, 96), 1.0 + 2.0 ** -8)
    ones = torch.ones(32, 96, dtype=torch.bfloat16)
    y = cpu_kernels.AmxWeight(ones).matmul(half)
    assert torch.equal(y, torch.full((1, 32), 96 * float(half.to(torch.bfloat16)[0, 0])))
    assert amx.matmul(torch.empty(0, 96)).shape == (0, 64)


@needs_amx
def test_kernel_rejects_what_it_cannot_take() -> None:
    w = torch.randn(64, 96).to(torch.bfloat16)
    assert cpu_kernels.AmxWeight.fits(w)
    for bad in (w[:, :80], w[:48], w.float(), w.half()):
        assert not cpu_kernels.AmxWeight.fits(bad)
        with pytest.raises(ValueError, match="multiples of 32"):
            cpu_kernels.AmxWeight(bad)
    amx = cpu_kernels.AmxWeight(w)
    with pytest.raises(ValueError, match="x must be"):
        amx.matmul(torch.randn(2, 95))
    with pytest.raises(ValueError, match="x must be"):
        amx.matmul(torch.randn(2, 96, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        cpu_kernels.AmxWeight(w, torch.randn(63))


def test_builds_without_amx_report_it_unavailable() -> None:
    if cpu_kernels.load("noamx") is None:
        pytest.skip("no C compiler")
    assert not cpu_kernels.amx_ready("noamx")
    with pytest.raises(RuntimeError, match="AMX"):
        cpu_kernels.AmxWeight(torch.randn(32, 32).to(torch.bfloat16), isa="noamx")


@needs_amx
def test_linear_takes_the_tiles_for_bfloat16_weights_that_fit() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = Linear(96, 64, bias=True)
    lin.weight.data.copy_(torch.randn(64, 96, generator=gen))
    lin.bias.data.copy_(torch.randn(64, generator=gen))
    ref_w = lin.weight.data.to(torch.bfloat16)
    lin.store_weight(ref_w)
    assert lin.enable_cpu_gemm() and lin.amx is not None
    for rows in (1, 7, Linear.DENSE_MIN_ROWS + 3):
        x = torch.randn(2, rows, 96, generator=gen)
        ref = _reference(x.reshape(-1, 96), ref_w, lin.bias.data).view(2, rows, 64)
        torch.testing.assert_close(lin(x).double(), ref, atol=2e-4, rtol=1e-5)
    # amx=False (and bf16_dot=False, the other 16-bit path these CPUs have): the widening
    # kernel, x not rounded.
    assert lin.enable_cpu_gemm(amx=False, bf16_dot=False) and lin.amx is None and lin.bf16dot is None
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(lin(x).double(), x.double() @ ref_w.double().T + lin.bias.double(), atol=1e-4, rtol=1e-5)
    # Other stored formats and shapes that are not whole 32-channel blocks never take the tiles.
    for weight in (torch.randn(64, 96).half(), torch.randn(50, 96).to(torch.bfloat16)):
        other = Linear(96, weight.shape[0])
        other.store_weight(weight)
        assert other.enable_cpu_gemm() and other.amx is None


@needs_amx
@pytest.mark.timeout(240)
def test_engine_runs_bfloat16_weights_on_the_tiles_unless_told_not_to(tiny_model_dir: Path) -> None:
    """The default packs every product's tiles, --no-cpu-amx none, and both generate (their
    tokens against transformers: test_weight_formats, which takes the tiles on AMX CPUs)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, (n,), generator=gen).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    counts = {}
    for amx in (True, False):
        llm = LLM(str(tiny_model_dir), device="cpu", num_pages=256, max_running_requests=4, dtype="bfloat16",
                  cpu_amx=amx)
        linears = [m for m in llm.scheduler.runner.model.modules() if isinstance(m, Linear)]
        counts[amx] = sum(m.amx is not None for m in linears)
        outs = llm.generate(prompts, params)
        assert all(len(o["token_ids"]) == 8 for o in outs)
    assert counts[True] == len(linears) and counts[False] == 0


@needs_amx
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (8, 2, 64), (8, 1, 256), (4, 4, 64)])
def test_amx_extend_attention_matches_the_float32_kernel(hq: int, hkv: int, d: int) -> None:
    """Q, K, V and the probabilities go through bfloat16 on the tiles (float32 softmax and
    sums): within bfloat16's rounding of the float32 kernel's output, every row filled."""
    q, k, v, kv_index, q_start, q_len, kv_len = extend_case(hq, hkv, d, hq * 100 + d)
    ref = torch.full_like(q, float("nan"))
    cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, ref, d**-0.5)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, out, d**-0.5, amx=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2)


def test_amx_extend_attention_is_refused_where_it_cannot_run() -> None:
    if cpu_kernels.load("noamx") is None:
        pytest.skip("no C compiler")
    q, k, v, kv_index, q_start, q_len, kv_len = extend_case(4, 2, 64, 0)
    with pytest.raises(RuntimeError, match="AMX attention is not available"):
        cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, torch.empty_like(q), 0.125,
                                     isa="noamx", amx=True)


@pytest.mark.timeout(240)
def test_prompt_attention_takes_the_tiles_only_beside_amx_products(tiny_model_dir: Path) -> None:
    """bfloat16 weights on an AMX CPU: the cpu backend's long runs on the tiles too; float32
    weights, --no-cpu-amx, or a CPU without AMX: the float32 kernel."""
    from minisgl_mp.attention.cpu import CpuBackend

    for dtype, amx in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
        llm = LLM(str(tiny_model_dir), device="cpu", num_pages=64, max_running_requests=2, dtype=dtype, cpu_amx=amx)
        backend = llm.scheduler.runner.backend
        assert isinstance(backend, CpuBackend)
        expected = cpu_kernels.amx_ready() and dtype == "bfloat16" and amx
        assert backend.extend_amx == expected, (dtype, amx)
        out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 2
