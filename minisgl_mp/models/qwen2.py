"""Qwen2 / Qwen2.5: Llama's math with a bias on the q, k and v projections (none on o)."""

from __future__ import annotations

from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, qkv_bias=True, o_bias=False)
