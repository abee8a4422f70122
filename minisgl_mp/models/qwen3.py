"""Qwen3 dense: the math only. Checkpoint names, fusing and sharding live in the loader."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.attention.base import AttentionContext
from minisgl_mp.layers.activation import silu_and_mul
from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.layers.qk_norm_rope import qk_norm_rope
from minisgl_mp.layers.rotary import RotaryEmbedding
from minisgl_mp.models.config import ModelConfig


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Fused q|k|v projection: rows [0, q) are q, then k, then v.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = qk_norm_rope(self.qkv_proj(x), positions, self.q_norm, self.k_norm, rope,
                               self.num_heads, self.num_kv_heads, self.head_dim)
        o = attn(q, k, v, self.layer_id)
        return self.o_proj(o.reshape(t, self.q_size))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Fused gate|up projection: rows [0, I) are gate, [I, 2I) are up.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_id)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryEmbedding, attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(positions, h, rope, attn)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> float32 logits [N, vocab] for the rows in
        `logits_indices` (all T rows when None)."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.rotary, attn)
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.forward_with_residual(x, residual)
        return self.lm_head(x).float()
