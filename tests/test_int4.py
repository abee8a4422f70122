"""int4 weights (`--quantization int4`): llama.cpp's Q4_1 blocks (kernels/int4.py).

The product kernel (kernels/csrc/weight_gemm.c, FMT_Q4) against float64 products of the
dequantized blocks for every vector path this machine can build, from one row (the streaming
path) through the widened panels (from PANEL_MIN_ROWS_Q4 rows); quantizing a float weight; a GGUF
file's Q4_1 and Q4_0 tensors held with the file's exact values (the gguf package's dequantized
tensor, after llama.cpp's q/k row permutation is undone); and the engine on the tiny model
(quantized at load) and on the shipped SmolLM2 Q4_1 file (its blocks as they are) against
float32 transformers, teacher-forced, with the one-call decode step equal to the modules.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import check_teacher_forced, torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.kernels import int4
from minisgl_mp.kernels.weights import vnni_ready
from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear
from minisgl_mp.models.gguf import GGUFTensors

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ROWS = (1, 2, 3, 4, 5, 7, 16, 33, 64)  # 4 | 5: the tiles | the panels (PANEL_MIN_ROWS_Q4)
TOL = 1e-3  # logits against transformers' float32 on the same values: float32 sums in another order
# (in, out): one block; odd channel counts around the register tiles and the panels' units
# (48 channels on AVX-512); K past one panel block (1024 steps).
SHAPES = ((32, 1), (96, 37), (576, 49), (1056, 131))


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


def test_kernel_matches_float64_products_of_the_dequantized_blocks(isa: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        blocks = int4.quantize(w)
        ref_w = int4.dequantize(blocks).double()
        stored = cpu_kernels.StoredWeight(blocks, None, bias, isa=isa)
        assert (stored.out_features, stored.in_features) == (n, k)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            for b in (None, bias):
                y = cpu_kernels.weight_gemm(x, blocks, None, b, isa=isa)
                ref = x.double() @ ref_w.T + (0 if b is None else b.double())
                # float32 sums of k products of magnitude ~1: rounding grows like sqrt(k) * 2^-24.
                torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5, msg=f"{isa} {m}x{k} -> {n}")


def test_quantize_rounds_each_block_to_its_grid() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 96, generator=gen)
    w[1, :32] = 0.75  # a constant block: d = 0, the value in m
    blocks = int4.quantize(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (5, 3 * 20)
    g = w.reshape(5, 3, 32)
    b = blocks.reshape(5, 3, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    torch.testing.assert_close(m, g.amin(-1, keepdim=True), atol=2e-3, rtol=1e-3)  # float16 of the minimum
    err = (int4.dequantize(blocks).reshape(5, 3, 32) - g).abs()
    # Half a step, and float16's rounding of d and m (a step of 15 d spans the block).
    assert (err <= d / 2 + 16 * 2 ** -11 * (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) + 1e-3).all()
    assert float(d[1, 0]) == 0 and (int4.dequantize(blocks)[1, :32] == 0.75).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        int4.quantize(torch.randn(2, 40))


def test_linear_and_embedding_paths_agree_with_the_dequantized_weight() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = Linear(96, 50, bias=True)
    lin.bias.data.copy_(torch.randn(50, generator=gen))
    blocks = int4.quantize(torch.randn(50, 96, generator=gen))
    lin.store_weight(blocks)
    ref_w = int4.dequantize(blocks).double()
    lin.WIDEN_TILE = 16  # several tiles, the last one partial
    for rows in (1, 9, Linear.DENSE_MIN_ROWS + 3):
        x = torch.randn(rows, 96, generator=gen)
        ref = x.double() @ ref_w.T + lin.bias.double()
        for use_kernel in (True, False):
            lin.cpu_gemm = use_kernel and lin.enable_cpu_gemm(vnni=False)
            torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)
        if vnni_ready():  # x rounded to int16 per block of 32 (tests/test_vnni_gemm.py)
            assert lin.enable_cpu_gemm() and lin.vnni is not None
            torch.testing.assert_close(lin(x).double(), ref, atol=2e-3, rtol=1e-3)
    emb = VocabEmbedding(50, 96)
    emb.store_weight(lin.weight)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(emb(ids), int4.dequantize(blocks)[ids])
    with pytest.raises(ValueError, match="weight shape"):
        lin.store_weight(int4.quantize(torch.randn(50, 64)))


# ---- GGUF files: the file's values, not quantized twice --------------------------------------

def _assert_blocks_are_the_files(tensors: GGUFTensors, names: list[str]) -> None:
    for name in names:
        blocks = tensors.int4_blocks(name)
        assert blocks is not None, name
        assert torch.equal(int4.dequantize(blocks), tensors.get_tensor(name)), name


def test_q4_1_file_blocks_dequantize_to_the_files_values() -> None:
    if not SMOLLM2.exists():
        pytest.skip("models/SmolLM2-135M-Instruct not fetched (make model)")
    tensors = GGUFTensors(SMOLLM2, 9, 3)
    names = [n for n in tensors.keys() if n.startswith("model.layers.0.") and n.endswith("proj.weight")]
    assert len(names) == 7  # q (permuted in the file), k (permuted), v, o, gate, up, down
    _assert_blocks_are_the_files(tensors, names)
    assert tensors.int4_blocks("model.embed_tokens.weight") is None  # Q8_0 in this file
    assert tensors.int4_blocks("model.layers.0.input_layernorm.weight") is None


def test_q4_0_file_blocks_dequantize_to_the_files_values(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    rng = np.random.default_rng(3)
    path = tmp_path / "q4_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    shapes = {"blk.0.attn_q.weight": (128, 64), "blk.0.attn_k.weight": (64, 64), "blk.0.ffn_down.weight": (64, 96)}
    for name, shape in shapes.items():
        data = quantize(rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFTensors(path, 4, 2)  # head dim 32: q of 4 heads, k of 2, each permuted
    _assert_blocks_are_the_files(tensors, list(tensors.keys()))


# ---- the engine ----------------------------------------------------------------------------------

def _hf_on_int4_weights(model_dir: Path) -> torch.nn.Module:
    """transformers' float32 model with each linear weight and the embedding replaced by its int4
    blocks' values (quantized per output row, as the engine quantizes its fused projections)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "norm" not in name:
                p.copy_(int4.dequantize(int4.quantize(p)))
    return hf


@pytest.mark.timeout(240)
def test_engine_quantizes_a_float_checkpoint_to_int4(tiny_model_dir: Path) -> None:
    """Every linear weight and the tied embedding as int4 blocks (one tensor), float32
    activations and KV, and every greedy token a best choice of transformers' float32 model on
    the same int4 values (only the order of float32 sums differs: gaps of 1e-5 in logits of ~30).
    Beside the float model itself int4 moves this random model's logits by several units."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024, max_running_requests=4, quantization="int4")
    model = llm.scheduler.runner.model
    assert all(m.weight.dtype == int4.STORAGE_DTYPE for m in model.modules() if isinstance(m, Linear))
    assert model.embed_tokens.weight is model.lm_head.weight
    assert llm.scheduler.runner.cpu_decode is not None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    hf = _hf_on_int4_weights(tiny_model_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out["token_ids"]) == 12
        check_teacher_forced(hf, prompt, out["token_ids"], tol=TOL)
    llm.shutdown()


def test_int4_needs_whole_blocks_of_inputs(make_checkpoint) -> None:
    ckpt = make_checkpoint({"hidden_size": 80})  # 80 inputs: not whole blocks of 32
    with pytest.raises(ValueError, match="multiple of 32.*--quantization int8"):
        LLM(str(ckpt), device="cpu", num_pages=64, quantization="int4")


@pytest.mark.timeout(300)
def test_engine_serves_the_q4_1_files_blocks(tmp_path: Path) -> None:
    """SmolLM2's Q4_1 file with --quantization int4: its Q4_1 tensors' blocks are the engine's
    weights (the fused q/k/v and gate/up of layer 0 dequantize to the file's values), its Q8_0
    tied embedding is int8; greedy answers against transformers' float32 model of the same
    file with that int8 embedding, teacher-forced: only the order of float32 sums parts them.
    (Beside the file's own Q8_0 embedding the int8 rounding moved a near tie by 0.14.)"""
    if not SMOLLM2.exists():
        pytest.skip("models/SmolLM2-135M-Instruct not fetched (make model)")
    with torch_threads():
        llm = LLM(str(SMOLLM2), device="cpu", num_pages=1024, max_running_requests=4, quantization="int4")
        model = llm.scheduler.runner.model
        assert model.embed_tokens.weight is model.lm_head.weight and model.lm_head.weight.dtype == torch.int8
        tensors = GGUFTensors(SMOLLM2, 9, 3)
        layer = model.layers[0]
        for fused, parts in ((layer.self_attn.qkv_proj, ("q", "k", "v")), (layer.mlp.gate_up_proj, ("gate", "up"))):
            assert fused.weight.dtype == int4.STORAGE_DTYPE
            kind = "self_attn" if len(parts) == 3 else "mlp"
            ref = torch.cat([tensors.get_tensor(f"model.layers.0.{kind}.{p}_proj.weight") for p in parts])
            assert torch.equal(int4.dequantize(fused.weight.data), ref)
        assert llm.scheduler.runner.cpu_decode is not None
        prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                  dtype=torch.float32).eval()
        with torch.no_grad():  # the embedding's int8 values (tied: the LM head's too)
            emb = model.embed_tokens
            hf.get_input_embeddings().weight.copy_(emb.weight.float() * emb.weight_scale[:, None])
        for prompt, out in zip(prompts, outs):
            check_teacher_forced(hf, prompt, out["token_ids"], tol=TOL)
        llm.shutdown()
