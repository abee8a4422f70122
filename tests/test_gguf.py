"""GGUF files as a llama.cpp user has them, written here by tools/make_gguf.py (llama.cpp's
metadata, tensor names and Llama's q/k permutation), one per architecture and tensor type.

Each loads through the offline engine from the file alone (config, tokenizer and chat template
from the metadata) and is checked against transformers' own GGUF loading of the same file
(`from_pretrained(folder, gguf_file=...)`): greedy tokens teacher-forced, token ids and the chat
template. transformers 5.25 loads all four architectures but ignores two keys this loader reads,
qwen3.attention.key_length and qwen3moe.expert_feed_forward_length (it takes its config classes'
defaults, head_dim 128 and moe_intermediate_size 768, and then refuses the tensors' shapes), so
its reference is given those two values by keyword. Then --dtype and --quantization int8 on a
GGUF load, and every way a file can be unservable, offline and through the launcher: one line
naming the file and the reason, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hf_reference import check_teacher_forced, torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.engine.tokenizer import load_tokenizer
from minisgl_mp.layers.linear import Linear
from minisgl_mp.models import gguf as gguf_module
from minisgl_mp.models.gguf import GGUFError
from minisgl_mp.models.source import resolve_model
from minisgl_mp.tools import make_gguf
from minisgl_mp.tools.qwen3_template import QWEN3_CHAT_TEMPLATE

# (architecture, tensor type): each type at least once, each architecture three or four times,
# both K-quants on a dense and on the MoE model.
# (make_gguf also writes Q5_0 and Q5_1, left out here for time: the same gguf dequantizer path.)
CASES = [("llama", "Q4_K"), ("llama", "F16"), ("llama", "Q4_0"),
         ("qwen2", "Q8_0"), ("qwen2", "Q6_K"), ("qwen2", "BF16"),
         ("qwen3", "Q4_1"), ("qwen3", "F32"),
         ("qwen3moe", "Q4_K"), ("qwen3moe", "Q6_K")]
PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):\n    return n", "Hello"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
TEXTS = ["Hello, world!", "  leading spaces and 12345 digits", "<|im_start|>user\nHi<|im_end|>\n",
         "<think>plan</think> déjà vu, 東京", "def f(x):\n\treturn x ** 2\n"]
# What transformers does not read from these files (see the module docstring), by keyword.
HF_OVERRIDES = {"qwen3": {"head_dim": make_gguf.SMALL["head_dim"]},
                "qwen3moe": {"moe_intermediate_size": make_gguf.MOE["moe_intermediate_size"],
                             "experts_implementation": "eager"}}


@pytest.fixture(scope="module", autouse=True)
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One thread, and the folders derived from each file in this module's temporary folder,
    not the user's cache."""
    cache = tmp_path_factory.mktemp("gguf-cache")
    with torch_threads(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_module, "_cache_root", lambda: cache)
        yield


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def gguf_file(root: Path, arch: str, qtype: str, **kwargs: Any) -> Path:
    """The file for (arch, qtype), alone in its folder as a hub repository's would be; written once."""
    path = root / f"{arch}-{qtype}" / f"{arch}-{qtype}.gguf"
    if not path.exists():
        make_gguf.write_gguf(path, arch, qtype, **kwargs)
    return path


def hf_model(file: Path, arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                **HF_OVERRIDES.get(arch, {})).eval()


def make_llm(model: Path, **kwargs: Any) -> LLM:
    return LLM(str(model), device="cpu", num_pages=512, max_running_requests=4, **({"dtype": "float32"} | kwargs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_greedy_follows_transformers_gguf_loading(gguf_dir: Path, arch: str, qtype: str) -> None:
    file = gguf_file(gguf_dir, arch, qtype)
    llm = make_llm(file.parent)  # the folder holding it, as a user passes a downloaded repository
    cfg = llm.scheduler.runner.model.config
    assert type(llm.scheduler.runner.model).__name__ == make_gguf.hf_config(arch)["architectures"][0]
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings) == (64, 2, make_gguf.TIED[arch])
    if arch == "qwen3moe":
        assert (cfg.num_experts, cfg.moe_intermediate_size) == (4, 256)
    hf = hf_model(file, arch)
    prompts = [llm.encode(p) for p in PROMPTS]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert len(out["token_ids"]) == GREEDY.max_tokens
        check_teacher_forced(hf, prompt, out["token_ids"])
    # Random weights of a useful scale: the answer is not one token repeated.
    assert len(set(out["token_ids"])) > 3, out["token_ids"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", list(make_gguf.ARCHS))
def test_tokenizer_and_chat_template_come_from_the_file(gguf_dir: Path, arch: str) -> None:
    from transformers import AutoTokenizer

    file = gguf_file(gguf_dir, arch, "Q8_0")
    ours = load_tokenizer(resolve_model(str(file)).tokenizer_dir)  # what the tokenizer process loads
    ref = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids) and text in ours.decode(ids), text
    assert ours.chat_template == QWEN3_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    im_start = ours.convert_tokens_to_ids("<|im_start|>")
    assert ours.encode("<|im_start|>") == ([ours.bos_token_id] if arch == "llama" else []) + [im_start]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kwargs", "dtype", "tol"), [({"dtype": "bfloat16"}, torch.bfloat16, 0.15),
                                                      ({"quantization": "int8"}, torch.int8, 0.75)],
                         ids=["bfloat16", "int8"])
def test_dtype_and_quantization_apply_to_a_gguf_load(gguf_dir: Path, kwargs: dict[str, Any], dtype: torch.dtype,
                                                     tol: float) -> None:
    # Tolerances as in test_weight_formats.py: the stored weights' rounding, against float32.
    file = gguf_file(gguf_dir, "qwen3", "Q8_0")
    llm = make_llm(file, **({"dtype": "auto"} | kwargs))
    model = llm.scheduler.runner.model
    assert all(m.weight.dtype == dtype for m in model.modules() if isinstance(m, Linear))
    assert model.embed_tokens.weight.dtype == dtype
    hf = hf_model(file, "qwen3")
    prompts = [llm.encode(p) for p in PROMPTS]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        check_teacher_forced(hf, prompt, out["token_ids"], tol=tol)


def test_the_config_is_the_metadata(gguf_dir: Path) -> None:
    for arch in make_gguf.ARCHS:
        derived = gguf_module.prepare_gguf(gguf_file(gguf_dir, arch, "Q8_0"))
        got = json.loads((derived / "config.json").read_text(encoding="utf-8"))
        want = make_gguf.hf_config(arch)
        keys = ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings"]
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"] if arch == "qwen3moe" else []
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, arch
        for k in ("rms_norm_eps", "rope_theta"):  # GGUF stores them as float32
            assert got[k] == pytest.approx(want[k], rel=1e-6), (arch, k)
        assert got.get("attention_bias", False) == (arch == "qwen2"), arch


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_writer_is_read_back_by_the_gguf_package(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    x[1] += 2.0  # a row all positive: Q4_K's offset must still cover it
    blocks, raw = make_gguf.encode(x, qtype)
    assert raw == GGMLQuantizationType[qtype] and blocks.dtype == np.uint8
    back = dequantize(blocks, raw)
    rms = float(np.sqrt(((back - x) ** 2).mean()) / x.std())
    assert rms < {"Q4_K": 0.1, "Q6_K": 0.03}[qtype], rms  # 4 and 6 bits: about 7% and 2% measured


# ---- files that cannot be served ---------------------------------------------------------------------------


def _retyped(src: Path, dst: Path, tensor: str, type_id: int) -> Path:
    """`src` with one tensor's type id in its header replaced (the data left as it was)."""
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """name -> (the file or folder, a phrase its error must hold)."""
    import gguf

    root = tmp_path_factory.mktemp("bad-gguf")
    good = make_gguf.write_gguf(root / "good.gguf", "qwen3", "Q8_0")
    data = good.read_bytes()
    files: dict[str, tuple[Path, str]] = {}

    def put(name: str, content: bytes, phrase: str) -> None:
        (root / name).write_bytes(content)
        files[name] = (root / name, phrase)

    put("truncated.gguf", data[: len(data) // 2], "truncated or corrupt")
    put("header-cut.gguf", data[:1000], "truncated or corrupt")
    put("random.gguf", np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not a GGUF file")
    put("empty.gguf", b"", "empty file")
    w = gguf.GGUFWriter(str(root / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files["mamba.gguf"] = (root / "mamba.gguf", "architecture 'mamba' is not supported")
    # The second of three parts llama-gguf-split writes: split.* keys and its share of the tensors.
    w = gguf.GGUFWriter(str(root / "tiny-00002-of-00003.gguf"), "qwen3")
    w.kv_data[0].clear()  # parts after the first carry no general.architecture
    w.add_uint16("split.no", 1)
    w.add_uint16("split.count", 3)
    w.add_int32("split.tensors.count", 30)
    w.add_tensor("blk.1.ffn_down.weight", np.zeros((256, 512), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files["split-part.gguf"] = (root / "tiny-00002-of-00003.gguf", "part 2 of a GGUF model split into 3 files, which "
                                f"is not served split: merge them into one first (llama-gguf-split --merge "
                                f"{root / 'tiny-00001-of-00003.gguf'} merged.gguf)")
    split = root / "split"
    split.mkdir()
    for name in ("tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"):
        shutil.copyfile(good, split / name)
    files["split-folder"] = (split, "holds one GGUF model split into 2 files (tiny-00001-of-00002.gguf, ...)")
    q81 = int(gguf.GGMLQuantizationType.Q8_1)  # in GGML's enum, but the gguf package cannot dequantize it
    files["q8_1.gguf"] = (_retyped(good, root / "q8_1.gguf", "blk.0.attn_q.weight", q81),
                          "'blk.0.attn_q.weight' is stored as Q8_1")
    files["type-99.gguf"] = (_retyped(good, root / "type-99.gguf", "blk.0.attn_q.weight", 99),
                             "a type the installed gguf package does not know")
    for name, omit, phrase in [("no-ffn-down.gguf", "blk.1.ffn_down.weight", "missing for a qwen3 model of 2 blocks: "
                                "blk.1.ffn_down.weight"),
                               ("no-head-count.gguf", "qwen3.attention.head_count", "lacks qwen3.attention.head_count"),
                               ("no-vocabulary.gguf", "tokenizer.ggml.tokens", "lacks tokenizer.ggml.tokens, so the "
                                "file has no vocabulary; pass --tokenizer")]:
        files[name] = (make_gguf.write_gguf(root / name, "qwen3", "Q8_0", omit=[omit]), phrase)
    two = root / "two-quantizations"
    two.mkdir()
    shutil.copyfile(good, two / "tiny-Q8_0.gguf")
    shutil.copyfile(good, two / "tiny-Q4_K.gguf")
    files["two-files"] = (two, "holds 2 GGUF files (tiny-Q4_K.gguf, tiny-Q8_0.gguf)")
    return files


BAD = ["truncated.gguf", "header-cut.gguf", "random.gguf", "empty.gguf", "mamba.gguf", "q8_1.gguf", "type-99.gguf",
       "no-ffn-down.gguf", "no-head-count.gguf", "no-vocabulary.gguf", "two-files", "split-part.gguf", "split-folder"]


@pytest.mark.parametrize("name", BAD)
def test_an_unservable_file_raises_one_clear_error_offline(bad_files: dict[str, tuple[Path, str]], name: str) -> None:
    path, phrase = bad_files[name]
    with pytest.raises(GGUFError) as e:
        make_llm(path)
    message = str(e.value)
    assert message.startswith(str(path)) and phrase in message and "\n" not in message, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", BAD)
def test_the_launcher_refuses_an_unservable_file_in_one_line(bad_files: dict[str, tuple[Path, str]], name: str,
                                                             tmp_path: Path) -> None:
    path, phrase = bad_files[name]
    # Its own cache folder: a file refused after its config is derived leaves that behind.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "minisgl_mp.launch", "--model", str(path), "--port", "0",
                           "--zmq-port", "0", "--no-enable-http"], capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(path) in errors[0] and phrase in errors[0], proc.stderr


def test_a_file_without_a_vocabulary_serves_with_tokenizer(bad_files: dict[str, tuple[Path, str]],
                                                           tiny_model_dir: Path) -> None:
    # As vLLM: --tokenizer supplies what the file lacks (here the same tokenizer make_gguf writes).
    llm = make_llm(bad_files["no-vocabulary.gguf"][0], tokenizer=str(tiny_model_dir))
    assert llm.scheduler.runner.model.config.vocab_size == len(llm.tokenizer)
    out = llm.generate([llm.encode("Hello there")], GREEDY)[0]
    assert len(out["token_ids"]) == GREEDY.max_tokens and out["text"]


def test_make_gguf_cli_writes_the_same_file_for_the_same_seed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for out in (a, b):
        assert make_gguf.main(["--arch", "qwen2", "--type", "Q4_0", "--layers", "1", "--out", str(out)]) == 0
    assert f"wrote {a}" in capsys.readouterr().out
    assert a.read_bytes() == b.read_bytes()
