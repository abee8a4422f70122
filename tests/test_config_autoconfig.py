"""ModelConfig read through transformers' config classes (issue 44 item 2).

A checkpoint saved by the installed transformers writes today's key names (`num_local_experts`,
`rope_parameters`, `dtype`); the hub's published configs (configs/models/) use the older ones
(`num_experts`, `rope_theta`, `rope_scaling`, `torch_dtype`). Both must read as transformers reads
them: the saved checkpoints load with logits equal to transformers', and the published configs
read to the values the raw-key reader gave before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import PagedModel, hf_logits, load_hf_model, torch_threads
from minisgl_mp.attention.base import ForwardMode
from minisgl_mp.models.config import ARCHITECTURES, ModelConfig, RopeConfig
from minisgl_mp.tools.make_model import arch_config

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO_ROOT / "configs" / "models"
ATOL = 1e-4  # float32, |logit| well below 30: test_model_vs_hf's bound
# Rope forms the saved checkpoints carry: llama3 with an original length below the longest prompt,
# so the scaled frequencies matter; yarn in transformers 5's form.
SAVED_ROPE: dict[str, dict[str, Any]] = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "qwen2": {},
    "qwen3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": 1024}},
    "qwen3_moe": {"mlp_only_layers": [1]},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a small random checkpoint that transformers built and wrote with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = json.loads((CONFIGS_DIR / "qwen3-tiny.json").read_text())
    out = {}
    for arch in ARCHITECTURES:
        raw = arch_config(tiny, arch) | {"num_hidden_layers": 2} | SAVED_ROPE[arch]
        model_type = raw.pop("model_type")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw), dtype=torch.float32)
        out[arch] = tmp_path_factory.mktemp(arch) / "model"
        model.save_pretrained(out[arch])
    return out


def test_saved_configs_use_transformers_5_names(saved_by_transformers: dict[str, Path]) -> None:
    # What the raw-key reader missed: these keys, not the published configs' ones.
    for arch, folder in saved_by_transformers.items():
        saved = json.loads((folder / "config.json").read_text())
        assert "rope_parameters" in saved and "rope_theta" not in saved and "dtype" in saved, arch
    moe = json.loads((saved_by_transformers["qwen3_moe"] / "config.json").read_text())
    assert moe["num_local_experts"] == 8 and "num_experts" not in moe


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_checkpoint_saved_by_transformers_loads_with_its_logits(saved_by_transformers: dict[str, Path],
                                                                arch: str) -> None:
    folder = saved_by_transformers[arch]
    cfg = ModelConfig.from_file(folder / "config.json")
    assert (cfg.architecture, cfg.model_type) == (ARCHITECTURES[arch], arch)
    if arch == "qwen3_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
        assert [cfg.is_sparse_layer(i) for i in range(2)] == [True, False]
    expected_rope = {"llama": "llama3", "qwen3": "yarn"}.get(arch, "default")
    assert cfg.rope.rope_type == expected_rope
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = PagedModel.load(folder).run(ForwardMode.EXTEND, [0], [prompt])
    ref = hf_logits(load_hf_model(folder), prompt)
    assert ours.shape == ref.shape
    err = float((ours - ref).abs().max())
    assert err < ATOL, f"{arch}: max |logit - HF logit| {err:.2e}"


# The raw-key reader's values for the published configs, before it read through transformers:
# (layers, hidden, intermediate, heads, kv heads, head_dim, vocab, max positions, rms eps, tied,
#  eos ids, bos id, dtype), (theta, rope type, rope params), (experts, top k, expert width,
#  norm_topk_prob, sparse step, mlp-only layers).
LLAMA3_8B_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA3_1B_ROPE = LLAMA3_8B_ROPE | {"factor": 32.0}
DENSE = (0, 0, 0, False, 1, ())
QWEN_ROPE = (1e6, "default", {})
QWEN3_IDS = ((151645,), 151643, "bfloat16")
PUBLISHED: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]] = {
    "Llama-3.1-8B": ((32, 4096, 14336, 32, 8, 128, 128256, 131072, 1e-5, False, (128001,), 128000, "bfloat16"),
                     (5e5, "llama3", LLAMA3_8B_ROPE), DENSE),
    "Llama-3.2-1B": ((16, 2048, 8192, 32, 8, 64, 128256, 131072, 1e-5, True, (128001,), 128000, "bfloat16"),
                     (5e5, "llama3", LLAMA3_1B_ROPE), DENSE),
    "Qwen2.5-0.5B": ((24, 896, 4864, 14, 2, 64, 151936, 32768, 1e-6, True, (151643,), 151643, "bfloat16"),
                     QWEN_ROPE, DENSE),
    "Qwen2.5-7B": ((28, 3584, 18944, 28, 4, 128, 152064, 131072, 1e-6, False, (151643,), 151643, "bfloat16"),
                   QWEN_ROPE, DENSE),
    "Qwen3-0.6B": ((28, 1024, 3072, 16, 8, 128, 151936, 40960, 1e-6, True, *QWEN3_IDS), QWEN_ROPE, DENSE),
    "Qwen3-1.7B": ((28, 2048, 6144, 16, 8, 128, 151936, 40960, 1e-6, True, *QWEN3_IDS), QWEN_ROPE, DENSE),
    "Qwen3-4B": ((36, 2560, 9728, 32, 8, 128, 151936, 40960, 1e-6, True, *QWEN3_IDS), QWEN_ROPE, DENSE),
    "Qwen3-8B": ((36, 4096, 12288, 32, 8, 128, 151936, 40960, 1e-6, False, *QWEN3_IDS), QWEN_ROPE, DENSE),
    "Qwen3-30B-A3B": ((48, 2048, 6144, 32, 4, 128, 151936, 40960, 1e-6, False, *QWEN3_IDS), QWEN_ROPE,
                      (128, 8, 768, True, 1, ())),
    "qwen3-bench-small": ((8, 512, 1536, 8, 4, 64, 151936, 40960, 1e-6, True, (8002,), 8000, "bfloat16"),
                          QWEN_ROPE, DENSE),
    "qwen3-tiny": ((4, 256, 768, 4, 2, 64, 8192, 4096, 1e-6, True, (8002,), 8000, "float32"), QWEN_ROPE, DENSE),
}


def test_every_published_config_is_in_the_table() -> None:
    assert sorted(p.stem for p in CONFIGS_DIR.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_read_as_before(name: str) -> None:
    raw = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    cfg = ModelConfig.from_file(CONFIGS_DIR / f"{name}.json")
    shape, (theta, rope_type, params), moe = PUBLISHED[name]
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.tie_word_embeddings,
            cfg.eos_token_ids, cfg.bos_token_id, cfg.hf_dtype) == shape
    assert cfg.rope == RopeConfig(theta=theta, rope_type=rope_type, params=params)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.decoder_sparse_step, cfg.mlp_only_layers) == moe
    assert (cfg.architecture, cfg.model_type, cfg.attention_bias) == (raw["architectures"][0], raw["model_type"],
                                                                       False)


def test_experts_read_under_either_name(tiny_config: dict[str, Any]) -> None:
    raw = arch_config(tiny_config, "qwen3_moe")
    published = ModelConfig.from_dict(raw)
    saved = ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_experts"} | {"num_local_experts": 8})
    assert published == saved and saved.num_experts == 8


def test_experts_of_a_dense_model_type_are_ignored(tiny_config: dict[str, Any]) -> None:
    # transformers builds Qwen3ForCausalLM dense whatever MoE keys its config carries.
    cfg = ModelConfig.from_dict(tiny_config | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    assert cfg.num_experts == 0 and not any(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_from_hf_config_without_architectures_takes_model_type(tiny_config: dict[str, Any], model_type: str) -> None:
    # AutoConfig.from_pretrained(folder, gguf_file=...) leaves architectures None.
    from transformers import AutoConfig

    raw = {k: v for k, v in arch_config(tiny_config, model_type).items() if k not in ("architectures", "model_type")}
    hf = AutoConfig.for_model(model_type, **raw)
    assert hf.architectures is None
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.architecture == ARCHITECTURES[model_type]
    assert cfg == ModelConfig.from_dict(arch_config(tiny_config, model_type))


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_defaults_for_absent_keys_are_transformers(tiny_config: dict[str, Any], model_type: str) -> None:
    # Without head_dim, num_key_value_heads, rope_theta, eos/bos ids: each config class's own
    # default (Qwen3's head_dim is 128, Qwen2's and Qwen3's kv heads 32, Llama's eos id 2), checked
    # against the projection shapes of the model transformers builds from the same keys.
    from transformers import AutoConfig, AutoModelForCausalLM

    omit = ("head_dim", "num_key_value_heads", "rope_theta", "eos_token_id", "bos_token_id", "pad_token_id",
            "architectures")
    raw = {k: v for k, v in arch_config(tiny_config, model_type).items() if k not in omit}
    raw["num_attention_heads"] = 32  # a multiple of every default kv head count
    cfg = ModelConfig.from_dict(raw)
    hf = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        attn = AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    assert (cfg.q_size, cfg.kv_size) == (attn.q_proj.out_features, attn.k_proj.out_features)
    assert cfg.head_dim == attn.head_dim and cfg.rope.theta == 10000.0
    assert cfg.architecture == ARCHITECTURES[model_type]
    bos, eos = (1, (2,)) if model_type == "llama" else (None, ())
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (bos, eos)


def test_unknown_model_type_is_named(tiny_config: dict[str, Any]) -> None:
    from transformers import MistralConfig

    with pytest.raises(ValueError, match="model_type 'mistral' is not supported.*llama, qwen2, qwen3, qwen3_moe"):
        ModelConfig.from_dict(tiny_config | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported"):
        ModelConfig.from_hf_config(MistralConfig())
    with pytest.raises(ValueError, match="model_type 'no_such_model' is not supported"):
        ModelConfig.from_dict(tiny_config | {"model_type": "no_such_model"})


def test_transformers_refusal_is_a_value_error(tiny_config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="model config: transformers refuses it: .*hidden_size.*expected int"):
        ModelConfig.from_dict(tiny_config | {"hidden_size": "256"})


def test_reading_leaves_the_dict_as_it_was(tiny_config: dict[str, Any]) -> None:
    raw = tiny_config | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    before = json.dumps(raw, sort_keys=True)
    ModelConfig.from_dict(raw)
    assert json.dumps(raw, sort_keys=True) == before


def _python(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(150)
def test_importing_the_config_module_keeps_torch_out() -> None:
    # The launcher imports models/config.py at the top, and its spawned tokenizer and detokenizer
    # re-import the launcher's module before they block torch.
    out = _python("import sys\nimport minisgl_mp.launch, minisgl_mp.models.config\n"
                  "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    assert out.strip() == "[]"


@pytest.mark.timeout(150)
def test_configs_read_in_a_torch_free_process() -> None:
    out = _python("import sys\nfrom minisgl_mp.utils.no_torch import block_torch\nblock_torch()\n"
                  "from minisgl_mp.models.config import ModelConfig\n"
                  f"cfg = ModelConfig.from_file({str(CONFIGS_DIR / 'Qwen3-30B-A3B.json')!r})\n"
                  "print(cfg.num_experts, cfg.hf_dtype, sys.modules['torch'])\n")
    assert out.strip() == "128 bfloat16 None"
