"""The loader's tensor-parallel slices, in one process: each rank's weights are exactly its
rows/columns of the whole model's (query heads, KV heads, replicated when fewer than ranks,
MLP and expert columns, vocabulary rows with the last rank's padding zero), and a split that
cannot work is refused with the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import MakeCheckpoint
from minisgl_mp.distributed.shard import TPShard
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.registry import build_model
from minisgl_mp.models.source import resolve_model


def _build(model_dir: Path, shard: TPShard | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    source = resolve_model(str(model_dir), "auto", None)
    cfg = ModelConfig.from_file(source.config_path)
    model = build_model(source, cfg, torch.float32, torch.device("cpu"), progress=False, shard=shard)
    return cfg, dict(model.named_parameters())


def _rows(heads: range, d: int) -> slice:
    return slice(heads.start * d, heads.stop * d)


@pytest.mark.parametrize("overrides, arch", [({}, "qwen3"), ({"num_key_value_heads": 1, "vocab_size": 8191}, "qwen3"),
                                             ({}, "qwen3_moe"), ({}, "qwen2")])
def test_each_rank_loads_exactly_its_slices(make_checkpoint: MakeCheckpoint, overrides: dict, arch: str) -> None:
    ckpt = make_checkpoint(overrides, arch=arch)
    cfg, full = _build(ckpt, None)
    d, inter = cfg.head_dim, cfg.intermediate_size
    for rank in range(2):
        shard = TPShard(rank, 2)
        _, part = _build(ckpt, shard)
        q, kv = shard.q_heads(cfg), shard.kv_heads(cfg)
        w = full["layers.0.self_attn.qkv_proj.weight"]
        k_start, v_start = cfg.q_size, cfg.q_size + cfg.kv_size
        want = torch.cat([w[_rows(q, d)], w[k_start:][_rows(kv, d)], w[v_start:][_rows(kv, d)]])
        assert torch.equal(part["layers.0.self_attn.qkv_proj.weight"], want)
        if arch == "qwen2":  # q/k/v biases split with their rows
            b = full["layers.0.self_attn.qkv_proj.bias"]
            want = torch.cat([b[_rows(q, d)], b[k_start:][_rows(kv, d)], b[v_start:][_rows(kv, d)]])
            assert torch.equal(part["layers.0.self_attn.qkv_proj.bias"], want)
        assert torch.equal(part["layers.0.self_attn.o_proj.weight"], full["layers.0.self_attn.o_proj.weight"][:, _rows(q, d)])
        if arch != "qwen2":
            assert torch.equal(part["layers.0.self_attn.q_norm.weight"], full["layers.0.self_attn.q_norm.weight"])
        if arch == "qwen3_moe":
            cols, mi = shard.columns(cfg.moe_intermediate_size), cfg.moe_intermediate_size
            gu = full["layers.0.mlp.experts.gate_up_proj"]
            want = torch.cat([gu[:, cols.start:cols.stop], gu[:, mi + cols.start: mi + cols.stop]], dim=1)
            assert torch.equal(part["layers.0.mlp.experts.gate_up_proj"], want)
            down = full["layers.0.mlp.experts.down_proj"][:, :, cols.start:cols.stop]
            assert torch.equal(part["layers.0.mlp.experts.down_proj"], down)
            assert torch.equal(part["layers.0.mlp.gate.weight"], full["layers.0.mlp.gate.weight"])  # the router
        else:
            cols = shard.columns(inter)
            gu = full["layers.0.mlp.gate_up_proj.weight"]
            want = torch.cat([gu[cols.start:cols.stop], gu[inter + cols.start: inter + cols.stop]])
            assert torch.equal(part["layers.0.mlp.gate_up_proj.weight"], want)
            assert torch.equal(part["layers.0.mlp.down_proj.weight"], full["layers.0.mlp.down_proj.weight"][:, cols.start:cols.stop])
        rows = shard.vocab_rows(cfg)
        emb = part["embed_tokens.weight"]
        assert emb.shape[0] == shard.vocab_per_rank(cfg)
        assert torch.equal(emb[: len(rows)], full["embed_tokens.weight"][rows.start:rows.stop])
        assert not emb[len(rows):].any()  # padding rows (8191 over 2 ranks) are zero


def test_kv_heads_are_split_or_replicated_and_other_splits_refused() -> None:
    def cfg(heads: int, kv: int) -> ModelConfig:
        return ModelConfig.from_dict({"num_attention_heads": heads, "num_key_value_heads": kv, "hidden_size": 64,
                                      "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 10, "head_dim": 8})

    assert [TPShard(r, 4).kv_heads(cfg(8, 2)) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [TPShard(r, 2).kv_heads(cfg(8, 4)) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert TPShard(1, 2).rank_config(cfg(4, 1)).num_kv_heads == 1
    with pytest.raises(ValueError, match=r"--tp-size 2 must divide num_key_value_heads \(3\)"):
        TPShard(0, 2).check(cfg(6, 3))
    with pytest.raises(ValueError, match=r"--tp-size 4 must divide num_attention_heads \(6\)"):
        TPShard(0, 4).check(cfg(6, 6))
