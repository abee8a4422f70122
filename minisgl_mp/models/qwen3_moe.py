"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention, and in the sparse layers a router that
sends each token to its top-k experts. Layer i is sparse unless it is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; the others keep a dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.mlp import GatedMLP
from minisgl_mp.layers.moe import FusedExperts
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.decoder import DecoderLayer, DecoderLM
from minisgl_mp.models.qwen3 import Qwen3Attention


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Softmax over all experts first, then top-k (renormalised to sum 1 with norm_topk_prob),
        # in float32 as transformers does, so the routing does not depend on the model dtype.
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights.to(x.dtype))


class Qwen3MoeForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig) -> None:
        def mlp(i: int) -> nn.Module:
            if cfg.is_sparse_layer(i):
                return Qwen3MoeSparseBlock(cfg)
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

        super().__init__(cfg, (DecoderLayer(cfg, Qwen3Attention(cfg, i), mlp(i)) for i in range(cfg.num_layers)))
