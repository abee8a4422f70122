"""The model's architecture, read once from a Hugging Face `config.json` through transformers'
config classes, so that each key's name and default is the one transformers loads the checkpoint
with."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# NOTE: transformers is imported inside the readers, not here: its config module imports torch,
# and this module is imported by the launcher, whose spawned tokenizer and detokenizer processes
# must stay torch-free.
if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> architectures[0], for configs that name no architecture (a GGUF file's).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE_MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default", "linear", "llama3" or "yarn", as transformers names them.
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)
    # Per-frequency divisors of the inverse frequencies, [head_dim / 2]: how llama.cpp stores
    # Llama 3's rope scaling in a GGUF file (its rope_freqs tensor) instead of parameters.
    freq_divisors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported "
                "(supported: none, linear, llama3, yarn)"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf_dtype: str | None = None
    # Mixture of experts (Qwen3-MoE); num_experts 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"model config: num_experts_per_tok must be in [1, num_experts="
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("model config: moe_intermediate_size and decoder_sparse_step must be positive")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` routes to experts (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_len(self, requested: int | None) -> int:
        """The serving context length: `requested` (--context-length) or the model's own."""
        if requested is None:
            return self.max_position_embeddings
        if requested > self.max_position_embeddings:
            raise ValueError(f"context_length {requested} exceeds the model's "
                             f"max_position_embeddings {self.max_position_embeddings}")
        return requested

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of dtype."""
        return 2 * self.num_layers * self.kv_size

    @classmethod
    def from_hf_config(cls, hf: PretrainedConfig) -> ModelConfig:
        """From a transformers config object (`AutoConfig.from_pretrained(folder)`, also with
        `gguf_file=`): its attribute maps and defaults are the ones transformers builds the model
        with (`num_experts` for `num_local_experts`, rope_theta inside rope_parameters, ...)."""
        model_type = _supported_model_type(getattr(hf, "model_type", None))
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("model config: sliding-window attention (use_sliding_window) is not supported")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("model config: MLP biases (mlp_bias) are not supported")
        heads, hidden = int(hf.num_attention_heads), int(hf.hidden_size)
        eos = hf.eos_token_id
        eos_ids = tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = getattr(hf, "dtype", None)  # a torch.dtype where torch is importable, else its name
        moe = model_type in MOE_MODEL_TYPES
        return cls(
            architecture=(hf.architectures or [ARCHITECTURES[model_type]])[0],
            model_type=model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            # As transformers' attention modules read it: Qwen2 and Qwen3-MoE configs have no
            # head_dim field, Qwen3's defaults to 128.
            head_dim=int(getattr(hf, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            rope=_rope_from_hf(hf),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=None if hf.bos_token_id is None else int(hf.bos_token_id),
            hf_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
            num_experts=int(hf.num_experts) if moe else 0,
            num_experts_per_tok=int(hf.num_experts_per_tok) if moe else 0,
            moe_intermediate_size=int(hf.moe_intermediate_size) if moe else 0,
            norm_topk_prob=bool(hf.norm_topk_prob) if moe else False,
            decoder_sparse_step=int(hf.decoder_sparse_step) if moe else 1,
            mlp_only_layers=tuple(int(i) for i in hf.mlp_only_layers or ()) if moe else (),
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a config.json's contents; without a model_type it is read as Qwen3's."""
        from huggingface_hub.errors import StrictDataclassError
        from transformers import CONFIG_MAPPING

        model_type = _supported_model_type(cfg.get("model_type", "qwen3"))
        try:
            # A copy: transformers fills its rope dicts in place.
            hf = CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(cfg))
        except (StrictDataclassError, TypeError, ValueError) as e:
            # huggingface_hub's strict-dataclass errors put the reason on a second, indented line.
            raise ValueError(f"model config: transformers refuses it: {' '.join(str(e).split())}") from e
        return cls.from_hf_config(hf)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _supported_model_type(model_type: str | None) -> str:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model config: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return model_type


def _rope_from_hf(hf: PretrainedConfig) -> RopeConfig:
    # transformers 5 gathers rope_theta and the older `rope_scaling` (keyed `type` or
    # `rope_type`) into rope_parameters, and fills original_max_position_embeddings for llama3
    # and yarn from max_position_embeddings.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("model config: rope parameters per layer type are not supported")
    theta = float(params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", int(hf.max_position_embeddings))
    # Not a transformers key: models/gguf.py writes it for a GGUF file with a rope_freqs tensor.
    divisors = tuple(float(x) for x in getattr(hf, "rope_freq_divisors", None) or ())
    return RopeConfig(theta=theta, rope_type=rope_type, params=params, freq_divisors=divisors)
