"""CUDA-graph decode without a GPU: the batch-size buckets, the static input buffers and their
padding, and the model run over those buffers exactly as a captured graph runs it (the Triton
backend under TRITON_INTERPRET=1), against an eager sdpa decode. Capture and replay themselves
need CUDA (launch/gpu_check.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_reference import PagedModel, torch_threads  # noqa: E402
from minisgl_mp.attention import registry  # noqa: E402
from minisgl_mp.attention.base import BatchLayout, ForwardMode  # noqa: E402
from minisgl_mp.engine.cuda_graph import (  # noqa: E402
    DecodeGraphInputs, DecodeGraphRunner, capture_batch_sizes, padded_batch_size, padded_token_rows)
from minisgl_mp.engine_config import EngineConfig  # noqa: E402


def test_buckets_cover_every_batch_size_up_to_the_max() -> None:
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 35
    assert capture_batch_sizes(5) == (1, 2, 4, 5)
    assert capture_batch_sizes(300)[-4:] == (256, 272, 288, 300)
    for b in range(1, 301):
        padded = padded_batch_size(b, capture_batch_sizes(300))
        assert padded is not None and b <= padded <= b + 15
    assert padded_batch_size(3, sizes) == 4 and padded_batch_size(17, sizes) == 24
    assert padded_batch_size(257, sizes) is None
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_graph_size_defaults_and_limits() -> None:
    assert EngineConfig(model="m").graph_max_bs == 256
    assert EngineConfig(model="m", max_running_requests=48).graph_max_bs == 48
    assert EngineConfig(model="m", cuda_graph_max_bs=32).graph_max_bs == 32
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model="m", cuda_graph_max_bs=0)


def test_static_inputs_pad_rows_that_touch_no_request() -> None:
    inputs = DecodeGraphInputs.allocate(8, pad_slot=99, device=torch.device("cpu"))
    layout = BatchLayout(ForwardMode.DECODE, torch.tensor([5, 2, 7]), (10, 3, 6), (1, 1, 1), torch.tensor([40, 41, 42]))
    inputs.load(layout, torch.tensor([11, 12, 13]), torch.tensor([10, 3, 6]), padded_bs=4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [10, 3, 6, 0]
    assert inputs.out_loc[:4].tolist() == [40, 41, 42, 99]
    assert inputs.req_rows[:4].tolist() == [5, 2, 7, 0]
    assert inputs.seq_lens[:4].tolist() == [11, 4, 7, 0]
    # A smaller batch later re-pads the rows the bigger one used.
    inputs.load(BatchLayout(ForwardMode.DECODE, torch.tensor([1]), (4,), (1,), torch.tensor([50])),
                torch.tensor([9]), torch.tensor([4]), padded_bs=2)
    assert inputs.seq_lens[:2].tolist() == [5, 0] and inputs.out_loc[:2].tolist() == [50, 99]


def test_graph_runner_refuses_a_backend_that_cannot_be_captured(tiny_model_dir: Path) -> None:
    paged = PagedModel.load(tiny_model_dir)
    paged.use_backend("sdpa")
    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        DecodeGraphRunner(paged.model, paged.backend, paged.pool.pad_slot, 4, torch.device("cpu"))


@pytest.mark.skipif(not registry.is_available("triton", torch.device("cpu")), reason="triton not installed")
def test_a_padded_graph_batch_decodes_like_eager(tiny_model_dir: Path) -> None:
    """Three decodes in the bucket of four: the real rows' logits match an eager sdpa decode,
    and the padding row writes only the pad slot."""
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with torch_threads():
        paged = PagedModel.load(tiny_model_dir)
        paged.run(ForwardMode.EXTEND, [0, 1, 2], prompts)
        rows, lens = [0, 1, 2], [len(p) for p in prompts]
        out_loc = torch.stack([paged.table.table[r, n] for r, n in zip(rows, lens)])
        layout = BatchLayout(ForwardMode.DECODE, torch.tensor(rows), tuple(lens), (1, 1, 1), out_loc)
        ids, pos = torch.tensor([1, 2, 3]), torch.tensor(lens)

        pool_before = paged.pool.k.clone()
        paged.use_backend("triton")
        runner = DecodeGraphRunner(paged.model, paged.backend, paged.pool.pad_slot, 4, torch.device("cpu"))
        padded = padded_batch_size(3, runner.sizes)
        runner.inputs.load(layout, ids, pos, padded)
        with torch.inference_mode():
            graph_logits = runner.forward_static(padded)[:3]
        # NaN-safe: slots never written hold whatever the allocation held, NaN bit patterns included.
        differs = (paged.pool.k != pool_before) & ~(paged.pool.k.isnan() & pool_before.isnan())
        changed = differs.flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert sorted(changed) == sorted(out_loc.tolist() + [paged.pool.pad_slot])

        paged.use_backend("sdpa")
        eager = paged.run(ForwardMode.DECODE, rows, [[1], [2], [3]])
    torch.testing.assert_close(graph_logits, eager, atol=1e-4, rtol=1e-4)


def test_verify_graph_inputs_give_each_request_its_rows() -> None:
    """A verify graph's buffers: request i owns rows [i * Q, (i + 1) * Q); the rows it does not
    run, and the padding requests, write the pad slot and run no query."""
    inputs = DecodeGraphInputs.allocate(4, pad_slot=99, device=torch.device("cpu"), tokens_per_req=3)
    layout = BatchLayout(ForwardMode.EXTEND, torch.tensor([5, 2]), (10, 4), (3, 1), torch.tensor([40, 41, 42, 43]))
    assert inputs.fits(layout) and padded_token_rows(layout.extend_lens, 3) == [0, 1, 2, 3]
    assert not inputs.fits(BatchLayout(ForwardMode.EXTEND, torch.tensor([1]), (0,), (4,), torch.arange(4)))
    rows = inputs.load(layout, torch.tensor([11, 12, 13, 14]), torch.tensor([10, 11, 12, 4]), padded_bs=4)
    assert rows.tolist() == [0, 1, 2, 3]
    assert inputs.input_ids[:9].tolist() == [11, 12, 13, 14, 0, 0, 0, 0, 0]
    assert inputs.out_loc.tolist() == [40, 41, 42, 43] + [99] * 8
    assert inputs.q_len.tolist() == [3, 1, 0, 0] and inputs.prefix_len.tolist() == [10, 4, 0, 0]
    assert inputs.seq_lens.tolist() == [13, 5, 0, 0] and inputs.req_rows.tolist() == [5, 2, 0, 0]
    # A later batch re-pads what the one before used.
    layout = BatchLayout(ForwardMode.EXTEND, torch.tensor([7]), (6,), (2,), torch.tensor([50, 51]))
    assert inputs.load(layout, torch.tensor([1, 2]), torch.tensor([6, 7]), padded_bs=2).tolist() == [0, 1]
    assert inputs.out_loc[:6].tolist() == [50, 51, 99, 99, 99, 99]
    assert inputs.q_len[:2].tolist() == [2, 0] and inputs.seq_lens[:2].tolist() == [8, 0]


@pytest.mark.skipif(not registry.is_available("triton", torch.device("cpu")), reason="triton not installed")
def test_a_padded_verify_graph_batch_matches_eager(tiny_model_dir: Path) -> None:
    """Speculative verify rows in a graph of 4 tokens a request: two drafts (3 and 4 tokens) and
    a plain decode, in the bucket of four requests; every real row's logits match an eager sdpa
    extend of the same tokens, and only their slots and the pad slot are written."""
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    runs = [[1, 2, 3], [4, 5, 6, 7], [8]]
    with torch_threads():
        paged = PagedModel.load(tiny_model_dir)
        paged.run(ForwardMode.EXTEND, [0, 1, 2], prompts)
        rows, lens = [0, 1, 2], [len(p) for p in prompts]
        out_loc = torch.cat([paged.table.table[r, n:n + len(x)] for r, n, x in zip(rows, lens, runs)])
        layout = BatchLayout(ForwardMode.EXTEND, torch.tensor(rows), tuple(lens), tuple(map(len, runs)), out_loc)
        ids = torch.tensor([t for x in runs for t in x])
        pos = torch.tensor([n + j for n, x in zip(lens, runs) for j in range(len(x))])

        pool_before = paged.pool.k.clone()
        paged.use_backend("triton")
        runner = DecodeGraphRunner(paged.model, paged.backend, paged.pool.pad_slot, 4, torch.device("cpu"),
                                   tokens_per_req=4)
        assert runner.inputs.fits(layout) and not runner.can_run(layout)  # (nothing captured on the CPU)
        padded = padded_batch_size(3, runner.sizes)
        token_rows = runner.inputs.load(layout, ids, pos, padded)
        with torch.inference_mode():
            out = runner.forward_static(padded)
        assert out.shape[0] == padded * 4 and torch.isfinite(out).all()
        graph_logits = out[token_rows]
        differs = (paged.pool.k != pool_before) & ~(paged.pool.k.isnan() & pool_before.isnan())
        changed = differs.flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert sorted(changed) == sorted(out_loc.tolist() + [paged.pool.pad_slot])

        paged.use_backend("sdpa")
        eager = paged.run(ForwardMode.EXTEND, rows, runs)
    torch.testing.assert_close(graph_logits, eager, atol=1e-4, rtol=1e-4)
