"""Qwen3 dense: the math only (Llama's layout plus a per-head RMSNorm on q and k). Checkpoint
names, fusing and sharding live in the loader."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.attention.base import AttentionContext
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.mlp import GatedMLP
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.layers.qk_norm_rope import qk_norm_rope
from minisgl_mp.layers.rotary import RotaryEmbedding
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.decoder import DecoderLayer, DecoderLM


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Fused q|k|v projection: rows [0, q) are q, then k, then v.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = qk_norm_rope(self.qkv_proj(x), positions, self.q_norm, self.k_norm, rope,
                               self.num_heads, self.num_kv_heads, self.head_dim)
        o = attn(q, k, v, self.layer_id)
        return self.o_proj(o.reshape(t, self.q_size))


class Qwen3ForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (
            DecoderLayer(cfg, Qwen3Attention(cfg, i), GatedMLP(cfg.hidden_size, cfg.intermediate_size))
            for i in range(cfg.num_layers)
        ))
