"""The model's architecture, read once from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default", "linear", "llama3" or "yarn", as transformers names them.
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)

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
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["Qwen3ForCausalLM"]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if cfg.get("use_sliding_window"):
            raise ValueError("model config: sliding-window attention (use_sliding_window) is not supported")
        if cfg.get("mlp_bias"):
            raise ValueError("model config: MLP biases (mlp_bias) are not supported")
        return cls(
            architecture=archs[0],
            model_type=cfg.get("model_type", "qwen3"),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=_rope_from_dict(cfg),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            hf_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            num_experts=int(cfg.get("num_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    # Older checkpoints say `rope_scaling` (with `type` or `rope_type`); transformers 5 writes
    # `rope_parameters`, which also carries rope_theta.
    scaling = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(scaling.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    return RopeConfig(theta=theta, rope_type=rope_type, params=scaling)
