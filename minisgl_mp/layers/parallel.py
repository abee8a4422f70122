"""Tensor-parallel layers, and `apply_tp`, which puts them into a model whose weights are
already this rank's slices (built from `TPShard.rank_config`, filled by the loader).

The models stay the math of one device: a rank's model is the same class with fewer heads,
fewer MLP columns and fewer vocabulary rows. What a rank must add is communication, at three
places per layer stack (Megatron's pattern, as in SGLang):

    q/k/v, gate/up  column-parallel: a rank's rows of the product need nothing from the others
    o, down, experts their partial sums are all-reduced (`AllReduceOutput`)
    embedding       each rank embeds the ids in its vocab rows, zeros elsewhere; all-reduced
    LM head         each rank's logit columns, all-gathered into the full vocabulary
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.layers.embedding import VocabEmbedding
from minisgl_mp.layers.linear import Linear
from minisgl_mp.models.config import ModelConfig


class AllReduceOutput(nn.Module):
    """A row-parallel product: `inner` (a Linear, or the experts of an MoE block) on this
    rank's input columns, summed over the ranks."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        bias = getattr(inner, "bias", None)
        if bias is not None and group.rank != 0:
            bias.data.zero_()  # the sum over ranks must add the bias once

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(*args))


class VocabParallelEmbedding(nn.Module):
    """weight: this rank's rows [start, start + n) of the embedding table (padding rows zero)."""

    def __init__(self, weight: nn.Parameter, start: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # the same Parameter the tied LM head holds
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """inner: this rank's vocab rows of the head; the output is the full [.., vocab] logits on
    every rank (all-gathered, the padding columns dropped), so sampling is the same everywhere."""

    def __init__(self, inner: Linear, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(x))[..., : self.vocab_size]


def apply_tp(model: nn.Module, cfg: ModelConfig, group: TPGroup) -> nn.Module:
    """Wrap a rank's loaded model (a `DecoderLM` of `TPShard.rank_config(cfg)` shapes) with
    its collectives; `cfg` is the whole model's config. Returns the model."""
    for layer in model.layers:
        attn = layer.self_attn
        attn.o_proj = AllReduceOutput(attn.o_proj, group)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # MoE: each expert's intermediate columns are split
            mlp.experts = AllReduceOutput(mlp.experts, group)
        else:
            mlp.down_proj = AllReduceOutput(mlp.down_proj, group)
    if not isinstance(model.embed_tokens, VocabEmbedding) or not isinstance(model.lm_head, Linear):
        raise TypeError("apply_tp expects a DecoderLM with a VocabEmbedding and a Linear LM head")
    start = group.shard.vocab_rows(cfg).start
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, start, group)
    model.lm_head = ParallelLMHead(model.lm_head, cfg.vocab_size, group)
    return model
