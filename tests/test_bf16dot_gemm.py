"""bfloat16 weights on AVX512-BF16's dot-product instruction (kernels/csrc/bf16dot_gemm.c), for
CPUs that have it but no AMX (AMD Zen 4 and 5, for one).

The kernel against float64 products of the same bfloat16 operands (x rounded to bfloat16 as
the kernel does): row counts around its 8-row groups, channel counts around its 48-channel
units and their 16-channel steps, a K longer than its block of K, with and without a bias and
with strided rows; `Linear` choosing it for bfloat16 weights where AMX is not taken; the
engine's `--no-cpu-bf16-dot` giving the widening path; prompt attention on the same
instruction (kernels/csrc/bf16dot_attention.c) against the float32 kernel, and the cpu backend
taking it only beside such products. In a build without AVX512-BF16 (the
`avx2` one on every x86 CPU) the kernel reports itself unavailable and nothing uses it. The
engine's tokens against transformers: tests/test_weight_formats.py, whose bfloat16 case runs
this kernel on such CPUs; the decode plan's logits: tests/test_cpu_decode_plan.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.linear import Linear

from attention_cases import extend_case  # noqa: E402

needs_dot = pytest.mark.skipif(not cpu_kernels.bf16dot_ready(), reason="no AVX512-BF16 on this CPU (or no C compiler)")
# On an AMX CPU the tiles come first; the dot products are what --no-cpu-amx leaves.
AMX = cpu_kernels.amx_ready()

# (in, out): one unit; two units and a 16-channel tail; a 7-channel unit of padding; K past
# the kernel's 4,096-input block (a second pass through y), with a narrow unit.
SHAPES = ((64, 48), (96, 112), (2, 7), (8194, 20))
ROWS = (1, 5, 8, 9, 17, 64, 129)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.to(torch.bfloat16).double() @ w.double().T
    return y if bias is None else y + bias.double()


@needs_dot
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_matches_float64_products_of_its_bfloat16_operands(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        dot = cpu_kernels.Bf16DotWeight(w, b)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            # float32 sums of k products of bfloat16 operands ~1: rounding grows like sqrt(k) * 2^-24.
            atol = 2e-4 * max(1.0, (k / 2048) ** 0.5)
            torch.testing.assert_close(dot.matmul(x).double(), _reference(x, w, b), atol=atol, rtol=1e-5,
                                       msg=f"{rows}x{k} -> {n}, bias {b is not None}")


@needs_dot
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_take_units_as_they_come_and_give_one_threads_bits(threads: int) -> None:
    """The threads take runs of 48-channel units as they come (claim_units.h), so which thread
    computes a unit changes from call to call; each unit is computed the same way whoever takes
    it, so the product is bit for bit the one-thread product, with more threads than units too,
    and over a wide output whose runs shrink to single units."""
    gen = torch.Generator().manual_seed(7)
    before = torch.get_num_threads()
    shapes = ((1, 256, 300), (2, 512, 80), (8, 300, 1000), (40, 128, 3000), (129, 96, 112))
    cases = [(torch.randn(rows, k, generator=gen), cpu_kernels.Bf16DotWeight(torch.randn(n, k, generator=gen)
              .to(torch.bfloat16), torch.randn(n, generator=gen))) for rows, k, n in shapes]
    try:
        torch.set_num_threads(1)
        alone = [w.matmul(x) for x, w in cases]
        torch.set_num_threads(threads)  # the kernels share torch's OpenMP runtime
        for _ in range(3):
            for (x, w), y in zip(cases, alone):
                assert torch.equal(w.matmul(x), y), f"{threads} threads {tuple(x.shape)} -> {y.shape[1]}"
    finally:
        torch.set_num_threads(before)


@needs_dot
def test_kernel_takes_strided_rows_and_rounds_x_to_nearest_even() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    dot = cpu_kernels.Bf16DotWeight(w)
    wide = torch.randn(40, 160, generator=gen)
    x = wide[:, 32:128]  # rows 160 floats apart
    torch.testing.assert_close(dot.matmul(x).double(), _reference(x, w, None), atol=2e-4, rtol=1e-5)
    # A value halfway between two bfloat16 numbers goes to the even one, as torch rounds it.
    half = torch.full((1, 96), 1.0 + 2.0 ** -8)
    ones = torch.ones(16, 96, dtype=torch.bfloat16)
    y = cpu_kernels.Bf16DotWeight(ones).matmul(half)
    assert torch.equal(y, torch.full((1, 16), 96 * float(half.to(torch.bfloat16)[0, 0])))
    assert dot.matmul(torch.empty(0, 96)).shape == (0, 64)


@needs_dot
def test_kernel_rejects_what_it_cannot_take() -> None:
    w = torch.randn(50, 96).to(torch.bfloat16)
    assert cpu_kernels.Bf16DotWeight.fits(w)
    for bad in (w[:, :95].contiguous(), w.float(), w.half()):
        assert not cpu_kernels.Bf16DotWeight.fits(bad)
        with pytest.raises(ValueError, match="even number of inputs"):
            cpu_kernels.Bf16DotWeight(bad)
    dot = cpu_kernels.Bf16DotWeight(w)
    with pytest.raises(ValueError, match="x must be"):
        dot.matmul(torch.randn(2, 95))
    with pytest.raises(ValueError, match="x must be"):
        dot.matmul(torch.randn(2, 96, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        cpu_kernels.Bf16DotWeight(w, torch.randn(49))


def test_builds_without_avx512_bf16_report_it_unavailable() -> None:
    if cpu_kernels.load("avx2") is None:
        pytest.skip("no C compiler, or not an x86 CPU")
    assert not cpu_kernels.bf16dot_ready("avx2")
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        cpu_kernels.Bf16DotWeight(torch.randn(16, 16).to(torch.bfloat16), isa="avx2")


@needs_dot
def test_linear_takes_the_dot_products_for_bfloat16_weights() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = Linear(72, 50, bias=True)
    lin.weight.data.copy_(torch.randn(50, 72, generator=gen))
    lin.bias.data.copy_(torch.randn(50, generator=gen))
    ref_w = lin.weight.data.to(torch.bfloat16)
    lin.store_weight(ref_w)
    # 72 x 50 is not whole 32-channel blocks: the dot products even where AMX is at hand.
    assert lin.enable_cpu_gemm() and lin.bf16dot is not None and lin.amx is None
    for rows in (1, 7, Linear.DENSE_MIN_ROWS + 3):
        x = torch.randn(2, rows, 72, generator=gen)
        ref = _reference(x.reshape(-1, 72), ref_w, lin.bias.data).view(2, rows, 50)
        torch.testing.assert_close(lin(x).double(), ref, atol=2e-4, rtol=1e-5)
    # bf16_dot=False: the widening kernel, x not rounded.
    assert lin.enable_cpu_gemm(bf16_dot=False) and lin.bf16dot is None
    x = torch.randn(5, 72, generator=gen)
    torch.testing.assert_close(lin(x).double(), x.double() @ ref_w.double().T + lin.bias.double(), atol=1e-4, rtol=1e-5)
    # Other stored formats never take it.
    other = Linear(72, 50)
    other.store_weight(torch.randn(50, 72).half())
    assert other.enable_cpu_gemm() and other.bf16dot is None


@needs_dot
@pytest.mark.timeout(240)
def test_engine_runs_bfloat16_weights_on_the_dot_products_unless_told_not_to(tiny_model_dir: Path) -> None:
    """Without AMX in the way (--no-cpu-amx on an AMX CPU), the default packs every product's
    panels and --no-cpu-bf16-dot none, and both generate (their tokens against transformers:
    test_weight_formats, which takes the dot products on such CPUs)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, (n,), generator=gen).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    counts = {}
    for dot in (True, False):
        llm = LLM(str(tiny_model_dir), device="cpu", num_pages=256, max_running_requests=4, dtype="bfloat16",
                  cpu_amx=False, cpu_bf16_dot=dot)
        linears = [m for m in llm.scheduler.runner.model.modules() if isinstance(m, Linear)]
        counts[dot] = sum(m.bf16dot is not None for m in linears)
        outs = llm.generate(prompts, params)
        assert all(len(o["token_ids"]) == 8 for o in outs)
    assert counts[True] == len(linears) and counts[False] == 0


@needs_dot
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (8, 2, 64), (8, 1, 256), (4, 4, 64), (6, 2, 32)])
def test_dot_extend_attention_matches_the_float32_kernel(hq: int, hkv: int, d: int) -> None:
    """Q, K, V and the probabilities go through bfloat16 on the dot products (float32 softmax
    and sums), odd key tiles paired with zeros: within bfloat16's rounding of the float32
    kernel's output, every row filled."""
    q, k, v, kv_index, q_start, q_len, kv_len = extend_case(hq, hkv, d, hq * 100 + d)
    ref = torch.full_like(q, float("nan"))
    cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, ref, d**-0.5)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, out, d**-0.5, dot=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2)


def test_dot_extend_attention_is_refused_where_it_cannot_run() -> None:
    if cpu_kernels.load("avx2") is None:
        pytest.skip("no C compiler, or not an x86 CPU")
    q, k, v, kv_index, q_start, q_len, kv_len = extend_case(4, 2, 64, 0)
    with pytest.raises(RuntimeError, match="AVX512-BF16 attention is not available"):
        cpu_kernels.extend_attention(q, k, v, kv_index, q_start, q_len, kv_len, torch.empty_like(q), 0.125,
                                     isa="avx2", dot=True)


@pytest.mark.timeout(240)
def test_prompt_attention_takes_the_dot_products_only_beside_dot_products(tiny_model_dir: Path) -> None:
    """bfloat16 weights on the dot products (--no-cpu-amx where AMX is at hand): the cpu
    backend's long runs on them too; float32 weights or --no-cpu-bf16-dot: the float32 kernel."""
    from minisgl_mp.attention.cpu import CpuBackend

    for dtype, dot in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
        llm = LLM(str(tiny_model_dir), device="cpu", num_pages=64, max_running_requests=2, dtype=dtype,
                  cpu_amx=False, cpu_bf16_dot=dot)
        backend = llm.scheduler.runner.backend
        assert isinstance(backend, CpuBackend)
        assert not backend.extend_amx
        assert backend.extend_dot == (cpu_kernels.bf16dot_ready() and dtype == "bfloat16" and dot), (dtype, dot)
        out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 2
