"""The pre-norm decoder every model here shares: embed, N x (norm, attention, norm, MLP), norm,
LM head. A model file supplies the attention and MLP of each layer; this is the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from minisgl_mp.attention.base import AttentionContext
from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.layers.rotary import RotaryEmbedding
from minisgl_mp.models.config import ModelConfig


class DecoderLayer(nn.Module):
    """`self_attn(positions, x, rope, attn)` and `mlp(x)` between two RMSNorms with residuals."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryEmbedding, attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(positions, h, rope, attn)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Iterable[DecoderLayer]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # An engine may run all the layers another way (engine/cpu_decode.py): called with
        # (x, positions, attn), it returns (x, residual) as the loop below would, or None for
        # steps it does not take.
        self.layer_runner: Callable[[torch.Tensor, torch.Tensor, AttentionContext],
                                    tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> float32 logits [N, vocab] for the rows in
        `logits_indices` (all T rows when None)."""
        x = self.embed_tokens(input_ids)
        ran = self.layer_runner(x, positions, attn) if self.layer_runner is not None else None
        if ran is not None:
            x, residual = ran
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(positions, x, residual, self.rotary, attn)
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.forward_with_residual(x, residual)
        return self.lm_head(x).float()
