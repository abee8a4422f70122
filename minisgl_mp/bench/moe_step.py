"""One mixture-of-experts layer against the dense layer of the same active size.

    python -m minisgl_mp.bench.moe_step [--config configs/models/Qwen3-30B-A3B.json] [--threads 2]

Per token count T, the feed-forward half of one layer in float32 on the CPU:
- moe: `Qwen3MoeSparseBlock` with the config's experts (router, top-k, the grouped expert
  products), x ~ N(0, 1) through random weights, so the routing is near uniform;
- dense: `GatedMLP` of width top_k * moe_intermediate_size, the same parameters per token,
  with its Linear layers prepacked as the engine runs them.
Each row also gives how many experts had tokens (what the grouped loop iterates over) and the
expert weight bytes that reads, against the dense layer's: at small T both are bound by reading
weights, so the ratio of times should follow the ratio of bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from minisgl_mp.bench.decode_floor import median_ms
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.mlp import GatedMLP
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.qwen3_moe import Qwen3MoeSparseBlock

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen3-30B-A3B.json"



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dict(json.loads(args.config.read_text()))
    if not cfg.num_experts:
        raise SystemExit(f"{args.config} has no experts")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe = Qwen3MoeSparseBlock(cfg)
        dense = GatedMLP(cfg.hidden_size, cfg.num_experts_per_tok * cfg.moe_intermediate_size)
        for module in (moe, dense):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            for m in module.modules():
                if isinstance(m, Linear):
                    m.prepack()

        active = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        print(f"{args.config.stem}: {cfg.num_experts} experts, top {cfg.num_experts_per_tok}, hidden "
              f"{cfg.hidden_size}, expert width {cfg.moe_intermediate_size}; dense width "
              f"{cfg.num_experts_per_tok * cfg.moe_intermediate_size} ({active / 1e6:.1f}M parameters "
              f"per token both); float32, {args.threads} threads")
        expert_mb = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 / 1e6
        dense_mb = cfg.num_experts_per_tok * expert_mb
        print(f"{'tokens':>7} {'experts hit':>11} {'moe ms':>8} {'dense ms':>9} {'moe/dense':>9} "
              f"{'weight MB moe/dense':>20}")
        for t in args.tokens:
            x = torch.randn(t, cfg.hidden_size, generator=gen)
            ids = torch.topk(moe.gate(x), cfg.num_experts_per_tok, dim=-1).indices
            hit = int(torch.unique(ids).numel())
            moe_ms = median_ms(lambda: moe(x), args.reps)
            dense_ms = median_ms(lambda: dense(x), args.reps)
            print(f"{t:>7} {hit:>11} {moe_ms:>8.2f} {dense_ms:>9.2f} {moe_ms / dense_ms:>8.2f}x "
                  f"{hit * expert_mb:>9.0f} / {dense_mb:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
