"""Rotary position embedding (the rotate-half form Qwen and Llama use), with the scaling
variants transformers defines: default, linear, llama3 and yarn."""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl_mp.models.config import RopeConfig


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(dim: int, theta: float, p: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(dim, theta)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(p.get("beta_fast") or 32)
    high = correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attn_factor)


def compute_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim / 2], scale applied to cos and sin)."""
    inv_freq, scale = _scaled_inv_freq(rope, dim, max_pos)
    if rope.freq_divisors:
        if len(rope.freq_divisors) != dim // 2:
            raise ValueError(f"rope: {len(rope.freq_divisors)} frequency divisors for head_dim {dim} "
                             f"(expected {dim // 2})")
        inv_freq = inv_freq / torch.tensor(rope.freq_divisors, dtype=inv_freq.dtype)
    return inv_freq, scale


def _scaled_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    if rope.rope_type == "default":
        return _default_inv_freq(dim, rope.theta), 1.0
    if rope.rope_type == "linear":
        return _default_inv_freq(dim, rope.theta) / rope.params["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(dim, rope.theta, rope.params), 1.0
    return _yarn_inv_freq(dim, rope.theta, rope.params, max_pos)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; forward looks them up by position."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, scale = compute_inv_freq(rope, head_dim, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos_sin: [max_position, 2, head_dim]
        self.register_buffer(
            "cos_sin", torch.stack((emb.cos() * scale, emb.sin() * scale), dim=1), persistent=False
        )
        self.max_position = max_position
        self.cpu_kernels = False  # rotate in C, without norms (layers/qk_norm_rope.py)

    def enable_cpu_kernels(self) -> bool:
        self.cpu_kernels = self.cos_sin.device.type == "cpu" and self.cos_sin.dtype == torch.float32
        return self.cpu_kernels

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        cs = self.cos_sin.index_select(0, positions).to(q.dtype)
        cos, sin = cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
