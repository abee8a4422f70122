"""Loads Hugging Face safetensors checkpoints into our models.

Checkpoint names are mapped to our parameter names here; separate q/k/v and gate/up tensors
are copied into the fused projections. Every parameter (and every fused part of one) must be
filled exactly once, or loading fails with an error that names the tensor and the file.
Pickle-based `.bin` checkpoints are refused: loading them can run code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from minisgl_mp.models.config import ModelConfig


class WeightLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter name
    shard: str | None  # which part of a fused parameter, or None for the whole of it


# (pattern on the checkpoint name with "model." stripped, our name, part of the fused tensor)
_FUSED = [
    (re.compile(r"(layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)$"), r"\1qkv_proj.\3", 2),
    (re.compile(r"(layers\.\d+\.mlp\.)(gate|up)_proj\.weight$"), r"\1gate_up_proj.weight", 2),
]
# Checkpoint tensors that carry nothing we need.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _fused_sizes(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    return {
        "qkv_proj": [("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)],
        "gate_up_proj": [("gate", cfg.intermediate_size), ("up", cfg.intermediate_size)],
    }


def _map_name(ckpt_name: str) -> _Target | None:
    name = ckpt_name[len("model."):] if ckpt_name.startswith("model.") else ckpt_name
    for pattern, repl, group in _FUSED:
        m = pattern.search(name)
        if m:
            return _Target(pattern.sub(repl, name), m.group(group))
    return _Target(name, None)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightLoadError(f"{index}: no 'weight_map' in the sharded checkpoint index")
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
        hint = (f" (found {bins[0].name}: pickle-based checkpoints are not loaded, since "
                "unpickling can run code; convert it to safetensors)") if bins else ""
        raise WeightLoadError(f"no *.safetensors weights in {model_dir}{hint}")
    from safetensors import safe_open

    mapping: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    mapping[name] = file
        except Exception as e:  # safetensors raises several types for a damaged header
            raise WeightLoadError(f"{file}: cannot read safetensors header: {e}") from e
    return mapping


def load_weights(model: nn.Module, cfg: ModelConfig, model_dir: Path, progress: bool = True) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    fused = _fused_sizes(cfg)
    files = checkpoint_files(model_dir)
    loaded: dict[str, str] = {}  # our name (with ":part" for fused parts) -> checkpoint name
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)

    bar = tqdm(total=len(files), desc="Loading weights", unit="tensor", disable=not progress)
    for file, names in sorted(by_file.items()):
        if not file.exists():
            raise WeightLoadError(f"checkpoint file {file} is listed in the index but missing")
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise WeightLoadError(f"{file}: cannot open safetensors file: {e}") from e
        with handle as f:
            for ckpt_name in sorted(names):
                bar.update(1)
                if _IGNORED.search(ckpt_name) or (cfg.tie_word_embeddings and ckpt_name == "lm_head.weight"):
                    continue
                target = _map_name(ckpt_name)
                if target is None or target.param not in params:
                    raise WeightLoadError(f"unexpected tensor {ckpt_name!r} in {file.name}: the model has no such weight")
                try:
                    tensor = f.get_tensor(ckpt_name)
                except Exception as e:
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {file.name} cannot be read: {e}") from e
                dest = _destination(params[target.param], target, fused)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise WeightLoadError(
                        f"tensor {ckpt_name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                if not torch.isfinite(tensor).all():
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {file.name} contains NaN or inf")
                key = target.param + (f":{target.shard}" if target.shard else "")
                if key in loaded:
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {file.name} is given twice")
                loaded[key] = ckpt_name
                dest.copy_(tensor)
    bar.close()

    missing = [_ckpt_name_of(k) for k in _required_keys(params, fused, cfg) if k not in loaded]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightLoadError(
            f"{len(missing)} tensor(s) missing from the checkpoint in {model_dir}: {shown}"
        )


def _destination(param: torch.Tensor, target: _Target, fused: dict) -> torch.Tensor:
    if target.shard is None:
        return param.data
    kind = target.param.split(".")[-2]
    offset = 0
    for part, size in fused[kind]:
        if part == target.shard:
            return param.data.narrow(0, offset, size)
        offset += size
    raise WeightLoadError(f"unknown part {target.shard!r} of {target.param}")


def _required_keys(params: dict[str, torch.Tensor], fused: dict, cfg: ModelConfig) -> list[str]:
    keys = []
    for name in params:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        kind = name.split(".")[-2] if "." in name else ""
        if kind in fused:
            keys.extend(f"{name}:{part}" for part, _ in fused[kind])
        else:
            keys.append(name)
    return keys


def _ckpt_name_of(key: str) -> str:
    """Our parameter key back to the checkpoint's name, for error messages."""
    name, _, part = key.partition(":")
    if part:
        fused = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        name = name.replace(fused, f"{part}_proj")
    return name if name.startswith("lm_head") else f"model.{name}"


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for a model of a real shape when no checkpoint is at hand (benchmarks)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * std)
