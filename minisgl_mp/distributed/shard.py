"""Which slice of every weight one tensor-parallel rank holds (Megatron's split, as SGLang's).

    q/k/v, gate/up   column-parallel: each rank holds 1/N of the output rows (whole heads)
    o, down          row-parallel: 1/N of the input columns; the partial sums are all-reduced
    embedding, head  vocab-parallel: ceil(V/N) rows each, the last rank's tail padded with zeros
    norms, router    replicated

KV heads split evenly when N divides them; with fewer KV heads than ranks each KV head is
replicated on N / num_kv_heads ranks (the ranks whose query heads read it). Other splits (3 KV
heads over 2 ranks) would give a rank query heads of two groups and are refused, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minisgl_mp.models.config import ModelConfig


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError, naming the numbers, when `cfg` cannot be split over `size` ranks."""
        n = self.size
        if cfg.num_heads % n:
            raise ValueError(f"--tp-size {n} must divide num_attention_heads ({cfg.num_heads})")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ValueError(f"--tp-size {n} must divide num_key_value_heads ({cfg.num_kv_heads}) or be a "
                             "multiple of it (then each KV head is replicated)")
        if cfg.intermediate_size % n:
            raise ValueError(f"--tp-size {n} must divide intermediate_size ({cfg.intermediate_size})")
        if cfg.num_experts and cfg.moe_intermediate_size % n:
            raise ValueError(f"--tp-size {n} must divide moe_intermediate_size ({cfg.moe_intermediate_size})")

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's model is built with: its heads, its MLP columns, its vocab rows."""
        self.check(cfg)
        n = self.size
        return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, cfg.num_kv_heads // n),
                       intermediate_size=cfg.intermediate_size // n,
                       moe_intermediate_size=cfg.moe_intermediate_size // n,
                       vocab_size=self.vocab_per_rank(cfg))

    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        # Replicated: rank r's query heads all belong to KV head r // (N / num_kv_heads).
        head = self.rank // (self.size // cfg.num_kv_heads)
        return range(head, head + 1)

    def columns(self, total: int) -> range:
        """An even 1/N split of `total` (the MLP's intermediate size)."""
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_per_rank(self, cfg: ModelConfig) -> int:
        return _ceil_div(cfg.vocab_size, self.size)

    def vocab_rows(self, cfg: ModelConfig) -> range:
        """This rank's real vocabulary rows (the last rank's may be fewer than vocab_per_rank)."""
        per = self.vocab_per_rank(cfg)
        start = min(self.rank * per, cfg.vocab_size)
        return range(start, min(start + per, cfg.vocab_size))
