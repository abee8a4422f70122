"""Weights stored as float16 / bfloat16 / int8 on the CPU, float32 arithmetic (bfloat16 on an
AMX CPU: the tiles of csrc/amx_gemm.c, tests/test_amx_gemm.py; on an AVX512-BF16 CPU without
AMX: csrc/bf16dot_gemm.c, tests/test_bf16dot_gemm.py; the engine test here runs either).

The C product kernel (kernels/csrc/weight_gemm.c) against float64 products of the same stored
weights, for every format and every vector path this machine can build (AVX-512 where the CPU
has it, AVX2 and plain C everywhere: MINISGL_MP_CPU_ISA); `Linear`'s three paths (kernel,
widened tiles, fallback) against each other; and the engine with `--dtype` / `--quantization`
against transformers' float32 model, teacher-forced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import check_teacher_forced, load_hf_model
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.linear import Linear
from minisgl_mp.models.weight_format import quantize_int8

STORED = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
# (rows, in, out): one row and a few; K with and without a vector tail (and shorter than one
# unrolled step of the one-row path); channel counts that leave partial register tiles and
# thread blocks.
SHAPES = ((1, 64, 8), (1, 1027, 37), (1, 40, 3), (3, 33, 5), (4, 256, 130), (7, 100, 19), (9, 1024, 67))


def _isas() -> list[str]:
    isas = ["avx2", "scalar"]
    if cpu_kernels.kernel_isa("native") == 512:
        isas.insert(0, "native")
    return isas


def _stored_weight(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored weight, int8 scale or None, the float64 weight it stands for)."""
    if dtype == torch.int8:
        q, scale = quantize_int8(w)
        return q, scale, q.double() * scale.double()[:, None]
    stored = w.to(dtype)
    return stored, None, stored.double()


@pytest.fixture(scope="module", params=_isas())
def isa(request: pytest.FixtureRequest) -> str:
    if cpu_kernels.load(request.param) is None:
        pytest.skip("no C compiler: the kernels are not built here")
    return request.param


@pytest.mark.parametrize("dtype", STORED, ids=lambda d: str(d).replace("torch.", ""))
def test_kernel_matches_float64_products(isa: str, dtype: torch.dtype) -> None:
    assert cpu_kernels.kernel_isa(isa) == {"native": 512, "avx2": 256, "scalar": 0}[isa]
    gen = torch.Generator().manual_seed(0)
    for rows, k, n in SHAPES:
        x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        stored, scale, ref_w = _stored_weight(w, dtype)
        for b in (None, bias):
            y = cpu_kernels.weight_gemm(x, stored, scale, b, isa=isa)
            ref = x.double() @ ref_w.T + (0 if b is None else b.double())
            # float32 sums of k products of magnitude ~1: rounding grows like sqrt(k) * 2^-24.
            torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5, msg=f"{rows}x{k} -> {n}")


def test_kernel_rejects_mismatched_inputs() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="scale"):
        cpu_kernels.weight_gemm(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="x must be"):
        cpu_kernels.weight_gemm(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_kernels.weight_gemm(x, w.double())


@pytest.mark.parametrize("dtype", STORED[1:], ids=lambda d: str(d).replace("torch.", ""))
def test_linear_paths_agree_at_every_batch_size(dtype: torch.dtype) -> None:
    """The kernel (small batches), widened tiles (large batches, and without the kernel) and
    the stored weight's meaning agree, with the bias, on a 2-D and a 3-D input. (bfloat16 on
    the 16-bit units, x rounded too: tests/test_amx_gemm.py, tests/test_bf16dot_gemm.py.)"""
    gen = torch.Generator().manual_seed(1)
    lin = Linear(72, 50, bias=True)
    lin.weight.data.copy_(torch.randn(50, 72, generator=gen))
    lin.bias.data.copy_(torch.randn(50, generator=gen))
    stored, scale, ref_w = _stored_weight(lin.weight.data, dtype)
    lin.store_weight(stored, scale)
    lin.WIDEN_TILE = 16  # several tiles, the last one partial
    for rows in (1, 5, Linear.DENSE_MIN_ROWS + 3):
        x = torch.randn(rows, 72, generator=gen)
        ref = x.double() @ ref_w.T + lin.bias.double()
        for use_kernel in (True, False):
            lin.cpu_gemm = use_kernel and lin.enable_cpu_gemm(bf16_dot=False)
            torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)
            assert lin(x.view(1, rows, 72)).shape == (1, rows, 50)


# Teacher-forced tolerance per stored format, in logits (|logit| <= ~30 on the tiny model):
# the weights' relative rounding is 2^-11 (float16), 2^-8 (bfloat16) and up to 1/254 of each
# channel's largest weight (int8). Worst gaps measured here: 0, 0.053 and 0.34.
FORMATS = {"float16": ({"dtype": "float16"}, torch.float16, 0.02),
           "bfloat16": ({"dtype": "bfloat16"}, torch.bfloat16, 0.15),
           "int8": ({"quantization": "int8"}, torch.int8, 0.75)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", FORMATS)
def test_engine_with_stored_weights_follows_float32_transformers(tiny_model_dir: Path, name: str) -> None:
    """Smaller weights (half or a quarter of the bytes, the tied embedding still one tensor),
    float32 activations and KV, and every greedy token a best choice of the float32 model."""
    kwargs, dtype, tol = FORMATS[name]
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024, max_running_requests=4, **kwargs)
    runner = llm.scheduler.runner
    model = runner.model
    assert runner.dtype == torch.float32 and runner.pool.k.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight.dtype == dtype for m in linears) and model.embed_tokens.weight.dtype == dtype
    if model.config.tie_word_embeddings:
        assert model.embed_tokens.weight is model.lm_head.weight
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out["token_ids"]) == 12
        check_teacher_forced(hf, prompt, out["token_ids"], tol=tol)


def test_int8_quantization_is_per_channel_absmax() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.0, -2.0]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q[:, :].abs().max() == 127
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))
    assert (q[1] == 0).all()
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
