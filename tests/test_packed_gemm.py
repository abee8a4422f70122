"""The register-tiled float32 product over packed weight panels (kernels/csrc/packed_gemm.c).

Against float64 products for every vector path this machine can build (AVX-512 where the CPU
has it, AVX2 and plain C everywhere: MINISGL_MP_CPU_ISA), on shapes that leave partial row
tiles, partial units and partial vectors; below PACKED_X_MIN_ROWS rows, runs of units taken by
whichever thread is free (the one-thread product's bits on any thread count), and from there on
its packed-x path (row groups split over the threads, blocks of MC rows); `Linear` picking it
for every batch unless it holds oneDNN's copy, and agreeing with its other paths; and the
engine, whose decode batches and prefill chunks run through it without that copy, against
transformers, teacher-forced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_reference import check_teacher_forced, load_hf_model
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.linear import Linear

# (rows, in, out): rows around the row tiles (4, 6, 8) and past several of them; K of one
# step, a few and with no vector tail to speak of; N around 16 (a vector), 48 (a unit) and a
# vector with a single real channel in it.
SHAPES = ((2, 1, 1), (3, 3, 15), (5, 100, 16), (6, 64, 17), (7, 33, 33), (8, 256, 47), (9, 17, 48),
          (13, 1027, 49), (16, 128, 97), (25, 64, 130), (64, 96, 113), (70, 40, 200))
# The packed-x path (csrc/packed_gemm.c, from 128 rows in a vector build): at its threshold, a
# partial last row group, a unit and a half, and more rows than one block per thread holds
# (2 x 512 rows; on AVX2 a block is 510, whole groups of 6).
PACKED_X_SHAPES = ((128, 33, 49), (131, 64, 100), (257, 17, 48), (1100, 9, 20), (1031, 70, 97))
TILES = {"native": (48, 8), "avx2": (16, 6), "scalar": (16, 4)}


def _isas() -> list[str]:
    isas = ["avx2", "scalar"]
    if cpu_kernels.kernel_isa("native") == 512:
        isas.insert(0, "native")
    return isas


@pytest.fixture(scope="module", params=_isas())
def isa(request: pytest.FixtureRequest) -> str:
    if cpu_kernels.load(request.param) is None:
        pytest.skip("no C compiler: the kernels are not built here")
    return request.param


def test_packed_product_matches_float64(isa: str) -> None:
    assert cpu_kernels.packed_gemm_tile(isa) == TILES[isa]
    gen = torch.Generator().manual_seed(0)
    for rows, k, n in SHAPES + PACKED_X_SHAPES:
        x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        packed = cpu_kernels.PackedWeight(w, isa=isa)
        assert packed.panels.numel() == -(-n // 16) * 16 * k
        for b in (None, bias):
            y = packed.matmul(x, b)
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            # float32 sums of k products of magnitude ~1: rounding grows like sqrt(k) * 2^-24.
            torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5, msg=f"{isa} {rows}x{k} -> {n}")


@pytest.mark.parametrize("threads", [1, 3])
def test_packed_x_path_splits_rows_over_any_thread_count(isa: str, threads: int) -> None:
    """The packed-x path's row groups split over 1 and 3 threads (its threshold follows the
    thread count: at least 64 rows a thread), partial groups and blocks included."""
    gen = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels share torch's OpenMP runtime
    try:
        for rows, k, n in PACKED_X_SHAPES:
            x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            y = cpu_kernels.PackedWeight(w, isa=isa).matmul(x, bias)
            ref = x.double() @ w.double().T + bias.double()
            torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5, msg=f"{isa} {threads} {rows}x{k} -> {n}")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_row_streaming_path_gives_one_threads_bits_over_any_thread_count(isa: str, threads: int) -> None:
    """Below the packed-x path the threads take runs of units as they come, so which thread
    computes a unit changes from call to call; each unit is computed the same way whoever takes
    it, so the product is bit for bit the one-thread product, with more threads than units too
    (a unit is 48 channels, or 16), and over a wide output whose runs shrink to single units."""
    gen = torch.Generator().manual_seed(6)
    before = torch.get_num_threads()
    shapes = ((1, 256, 300), (2, 512, 80), (8, 300, 1000), (40, 128, 3000))  # all past the serial bound
    cases = [(torch.randn(rows, k, generator=gen), cpu_kernels.PackedWeight(torch.randn(n, k, generator=gen), isa=isa),
              torch.randn(n, generator=gen)) for rows, k, n in shapes]
    try:
        torch.set_num_threads(1)
        alone = [w.matmul(x, b) for x, w, b in cases]
        torch.set_num_threads(threads)  # the kernels share torch's OpenMP runtime
        for _ in range(3):
            for (x, w, b), y in zip(cases, alone):
                assert torch.equal(w.matmul(x, b), y), f"{isa} {threads} threads {tuple(x.shape)} -> {w.out_features}"
    finally:
        torch.set_num_threads(before)


def test_packed_product_takes_strided_rows_and_writes_only_its_output(isa: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 50, generator=gen)
    packed = cpu_kernels.PackedWeight(w, isa=isa)
    for rows in (11, 300):  # the row-streaming path, and the packed-x one
        wide = torch.randn(rows, 80, generator=gen)
        x = wide[:, 10:60]  # rows 80 apart
        torch.testing.assert_close(packed.matmul(x).double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    xt = torch.randn(50, 11, generator=gen).T  # columns not contiguous: copied first
    torch.testing.assert_close(packed.matmul(xt).double(), xt.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    # The weight packed is a copy: later changes to the source do not leak in.
    before = packed.matmul(x)
    w.zero_()
    assert torch.equal(packed.matmul(x), before)


def test_packed_product_rejects_what_it_cannot_take() -> None:
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    packed = cpu_kernels.PackedWeight(torch.randn(8, 16))
    with pytest.raises(ValueError, match="x must be"):
        packed.matmul(torch.randn(2, 15))
    with pytest.raises(ValueError, match="x must be"):
        packed.matmul(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias must be"):
        packed.matmul(torch.randn(2, 16), torch.randn(7))
    with pytest.raises(ValueError, match="weight must be"):
        cpu_kernels.PackedWeight(torch.randn(8, 16).half())


def test_linear_runs_decode_batches_through_the_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN's copy made (--cpu-prepack), 1 to PANELS_MAX_ROWS rows go through the
    panels and longer batches do not; every path gives F.linear's answer, with the bias, on
    2-D and 3-D inputs."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(2)
    lin = Linear(72, 50, bias=True)
    lin.weight.data.copy_(torch.randn(50, 72, generator=gen))
    lin.bias.data.copy_(torch.randn(50, generator=gen))
    lin.prepack()
    assert lin.enable_cpu_gemm() and lin.panels is not None
    calls = []
    matmul = cpu_kernels.PackedWeight.matmul
    monkeypatch.setattr(cpu_kernels.PackedWeight, "matmul", lambda self, x, b=None: calls.append(len(x)) or matmul(self, x, b))
    for rows in (1, 2, 9, 64, Linear.PANELS_MAX_ROWS, Linear.PANELS_MAX_ROWS + 1):
        calls.clear()
        x = torch.randn(rows, 72, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
        assert lin(x.view(1, rows, 72)).shape == (1, rows, 50)
        assert calls == ([rows, rows] if rows <= Linear.PANELS_MAX_ROWS else []), rows
    # Without oneDNN's copy (the engine's default where the panels are a vector build) the
    # panels take the long batches too.
    lin.packed_weight = None
    calls.clear()
    x = torch.randn(Linear.PANELS_MAX_ROWS + 1, 72, generator=gen)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    assert calls == [len(x)]
    # A new weight drops the panels of the old one.
    lin.store_weight(torch.randn(50, 72, generator=gen))
    assert lin.panels is None and not lin.cpu_gemm


@pytest.mark.timeout(240)
def test_engine_decode_batches_use_the_panels_and_follow_transformers(tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests decode together (six rows per product, through the panels), every greedy
    token a best choice of transformers' float32 model."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024, max_running_requests=8)
    model = llm.scheduler.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    assert all(m.panels is not None for m in linears)
    rows = []
    matmul = cpu_kernels.PackedWeight.matmul
    monkeypatch.setattr(cpu_kernels.PackedWeight, "matmul", lambda self, x, b=None: rows.append(len(x)) or matmul(self, x, b))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 41, 64)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert 6 in rows  # the decode steps with all six running
    hf = load_hf_model(tiny_model_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out["token_ids"]) == 10
        check_teacher_forced(hf, prompt, out["token_ids"])


@pytest.mark.timeout(240)
def test_engine_prefills_through_the_panels_without_onednn_copy(tiny_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the engine keeps no oneDNN copy of a float32 weight that vector panels hold
    (one weight copy fewer), so a 300-token prompt's products run on the panels' packed-x path,
    and its greedy tokens are still a best choice of transformers' model; --cpu-prepack brings
    the copy back."""
    if cpu_kernels.load() is None or not cpu_kernels.kernel_isa():
        pytest.skip("no vector build of the C kernels here: oneDNN's copy stays the prefill path")
    # Through the modules, whose product calls are watched here: by default the step's layers
    # run in one C call over the same panels, bit for bit (tests/test_cpu_decode_plan.py).
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024, max_running_requests=4, cpu_decode_plan=False)
    linears = [m for m in llm.scheduler.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.panels is not None and m.packed_weight is None for m in linears)
    rows = []
    matmul = cpu_kernels.PackedWeight.matmul
    monkeypatch.setattr(cpu_kernels.PackedWeight, "matmul", lambda self, x, b=None: rows.append(len(x)) or matmul(self, x, b))
    vocab = llm.scheduler.runner.model.config.vocab_size
    prompt = torch.randint(vocab, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert 300 in rows
    check_teacher_forced(load_hf_model(tiny_model_dir), prompt, out["token_ids"])
    forced = LLM(str(tiny_model_dir), device="cpu", num_pages=64, max_running_requests=1, cpu_prepack=True)
    assert all(m.packed_weight is not None for m in forced.scheduler.runner.model.modules() if isinstance(m, Linear))
