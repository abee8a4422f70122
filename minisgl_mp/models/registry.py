"""Model registry: a checkpoint's `architectures[0]` picks the class; `build_model` loads it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from minisgl_mp.distributed.shard import TPShard
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.loader import init_dummy_weights, load_weights
from minisgl_mp.models.llama import LlamaForCausalLM
from minisgl_mp.models.qwen2 import Qwen2ForCausalLM
from minisgl_mp.models.qwen3 import Qwen3ForCausalLM
from minisgl_mp.models.qwen3_moe import Qwen3MoeForCausalLM
from minisgl_mp.models.source import ModelSource

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(source: ModelSource, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                progress: bool = True, seed: int = 0, shard: TPShard | None = None,
                int4_blocks: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Instantiate on `device` in `dtype`, then fill from the checkpoint (or randomly when the
    source has no weights). With `shard`: this tensor-parallel rank's part of the model, with
    no collectives yet (`layers/parallel.apply_tp` adds them). `int4_blocks`: see `load_weights`."""
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg)(shard.rank_config(cfg) if shard is not None else cfg)
    if source.weights is None:
        init_dummy_weights(model, seed=seed + (shard.rank if shard is not None else 0))
    else:
        load_weights(model, cfg, source.weights, progress=progress, shard=shard, int4_blocks=int4_blocks)
    return model.eval()
