"""ModelConfig read from config.json (every rope form transformers writes), and the dtype and
device chosen for a model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from minisgl_mp.models.config import ModelConfig, RopeConfig
from minisgl_mp.utils.device import resolve_device, resolve_dtype

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_tiny_config_fields(tiny_config: dict[str, Any]) -> None:
    cfg = ModelConfig.from_dict(tiny_config)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (8192, 256, 768)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 2, 64)
    assert (cfg.q_size, cfg.kv_size) == (256, 128)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (8002,) and cfg.bos_token_id == 8000
    assert cfg.rope == RopeConfig(theta=1e6)
    assert cfg.hf_dtype == "float32"


ROPE_FORMS: dict[str, tuple[dict[str, Any], str, float, dict[str, Any]]] = {
    # name: (config keys, rope_type, theta, params we keep)
    "none": ({"rope_scaling": None}, "default", 1e6, {}),
    "legacy type key": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear", 1e6, {"factor": 2.0}),
    "llama3 without original length": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        "llama3", 1e6,
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 4096},
    ),
    "transformers 5 rope_parameters": (
        {"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                                   "original_max_position_embeddings": 1024}},
        "yarn", 5e5, {"factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    "rope_parameters default": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "default", 1e4, {},
    ),
}


@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_rope_forms_parse_as_transformers_reads_them(tiny_config: dict[str, Any], form: str) -> None:
    from transformers import Qwen3Config

    keys, rope_type, theta, params = ROPE_FORMS[form]
    raw = tiny_config | keys
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.rope_type, rope.theta, rope.params) == (rope_type, theta, params)
    hf = Qwen3Config(**raw).rope_parameters
    assert (hf["rope_type"], float(hf["rope_theta"])) == (rope_type, theta)
    for key, value in params.items():
        assert hf[key] == value, f"{key}: ours {value}, transformers {hf[key]}"


def test_unsupported_rope_type_is_named(tiny_config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="'dynamic'.*supported: none, linear, llama3, yarn"):
        ModelConfig.from_dict(tiny_config | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_defaults_for_keys_older_configs_omit(tiny_config: dict[str, Any]) -> None:
    # transformers' Qwen3Config defaults: head_dim 128 (not hidden / heads), rope_theta 1e4, no
    # eos; tests/test_config_autoconfig.py checks every architecture's defaults against its model.
    raw = {k: v for k, v in tiny_config.items() if k not in ("head_dim", "rope_theta", "eos_token_id", "architectures")}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 2
    assert cfg.rope.theta == 10000.0 and cfg.eos_token_ids == ()
    assert cfg.architecture == "Qwen3ForCausalLM"


def test_eos_list_and_dtype_key(tiny_config: dict[str, Any]) -> None:
    raw = {k: v for k, v in tiny_config.items() if k != "torch_dtype"}
    cfg = ModelConfig.from_dict(raw | {"eos_token_id": [8002, 8000], "dtype": "bfloat16"})
    assert cfg.eos_token_ids == (8002, 8000) and cfg.hf_dtype == "bfloat16"


@pytest.mark.parametrize("keys, message", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_attention_heads \\(4\\) must be a multiple"),
    ({"vocab_size": 0}, "vocab_size must be positive"),
    ({"num_hidden_layers": 0}, "num_layers must be positive"),
    ({"num_hidden_layers": -1}, "transformers refuses it: .*`num_hidden_layers` \\(-1\\)"),
])
def test_invalid_shapes_are_refused(tiny_config: dict[str, Any], keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(tiny_config | keys)


# ---- dtype and device ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, device, checkpoint, expected", [
    ("auto", CPU, "bfloat16", torch.float32),  # no fast bfloat16 on common CPUs
    ("auto", CPU, None, torch.float32),
    ("auto", CUDA, "float16", torch.float16),
    ("auto", CUDA, "torch.bfloat16", torch.bfloat16),
    ("auto", CUDA, "float32", torch.bfloat16),  # a float32 checkpoint is served in half precision
    ("auto", CUDA, None, torch.bfloat16),
    ("float32", CUDA, "bfloat16", torch.float32),
    ("bfloat16", CPU, "float32", torch.bfloat16),
    ("float16", CPU, None, torch.float16),
])
def test_resolve_dtype(dtype: str, device: torch.device, checkpoint: str | None, expected: torch.dtype) -> None:
    assert resolve_dtype(dtype, device, checkpoint) == expected


def test_unknown_dtype_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="'int8'.*auto.*float32.*bfloat16.*float16"):
        resolve_dtype("int8", CPU, None)


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="--device cuda:0: CUDA is not available"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("step, mlp_only", [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_sparse_layers_follow_transformers(tiny_config: dict[str, Any], step: int, mlp_only: list[int]) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from minisgl_mp.tools.make_model import arch_config

    raw = arch_config(tiny_config, "qwen3_moe") | {"num_hidden_layers": 6, "decoder_sparse_step": step,
                                                   "mlp_only_layers": mlp_only}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**raw))
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(6) if cfg.is_sparse_layer(i)] == hf_sparse


@pytest.mark.parametrize("bad, match", [
    ({"use_sliding_window": True}, "sliding-window"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 16},
     "num_experts_per_tok"),
])
def test_unsupported_or_inconsistent_configs_are_refused(tiny_config: dict[str, Any], bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(tiny_config | bad)


def test_gguf_rope_divisors_reproduce_llama3_scaling(tiny_config: dict[str, Any]) -> None:
    # llama.cpp stores Llama 3's rope scaling in a GGUF file as per-frequency divisors (its
    # rope_freqs tensor); read back from the derived config, they give llama3's frequencies.
    from minisgl_mp.layers.rotary import compute_inv_freq

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    scaled = ModelConfig.from_dict({**tiny_config, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                    "rope_scaling": llama3})
    dim = scaled.head_dim
    target, _ = compute_inv_freq(scaled.rope, dim, 128)
    plain = ModelConfig.from_dict({**tiny_config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    base, _ = compute_inv_freq(plain.rope, dim, 128)
    divisors = (base / target).tolist()
    assert any(d > 1.5 for d in divisors)  # the scaling changes some frequencies
    gguf_like = ModelConfig.from_dict({**tiny_config, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                       "rope_freq_divisors": divisors})
    assert gguf_like.rope.freq_divisors == tuple(divisors)
    got, _ = compute_inv_freq(gguf_like.rope, dim, 128)
    torch.testing.assert_close(got, target, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="frequency divisors"):
        compute_inv_freq(gguf_like.rope, dim * 2, 128)
