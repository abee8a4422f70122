"""Llama 3.x: the math only. Grouped-query attention without q/k norms; the rope scaling
(`llama3` for 3.1 and up) lives in the rotary table; 3.2-1B/3B tie the LM head to the embedding."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.attention.base import AttentionContext
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.mlp import GatedMLP
from minisgl_mp.layers.qk_norm_rope import qk_norm_rope
from minisgl_mp.layers.rotary import RotaryEmbedding
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.decoder import DecoderLayer, DecoderLM


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # Fused q|k|v projection: rows [0, q) are q, then k, then v.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = qk_norm_rope(self.qkv_proj(x), positions, None, None, rope, self.num_heads, self.num_kv_heads,
                               self.head_dim)
        o = attn(q, k, v, self.layer_id)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool | None = None, o_bias: bool | None = None) -> None:
        """Biases: Llama's `attention_bias` covers q, k, v and o alike; Qwen2 passes its own."""
        qkv_bias = cfg.attention_bias if qkv_bias is None else qkv_bias
        o_bias = cfg.attention_bias if o_bias is None else o_bias
        super().__init__(cfg, (
            DecoderLayer(cfg, LlamaAttention(cfg, i, qkv_bias, o_bias),
                         GatedMLP(cfg.hidden_size, cfg.intermediate_size))
            for i in range(cfg.num_layers)
        ))
