"""Loads Hugging Face safetensors checkpoints (and GGUF files, through `models/gguf.py`, whose
tensors arrive under the same names) into our models.

Checkpoint names are mapped to our parameter names here; separate q/k/v and gate/up tensors
are copied into the fused projections, and a mixture-of-experts layer's per-expert tensors
(`mlp.experts.<e>.gate_proj.weight`, ...) into its stacked expert weights. Every parameter (and every fused part of one) must be
filled exactly once, or loading fails with an error that names the tensor and the file.
Pickle-based `.bin` checkpoints are refused: loading them can run code.

Under tensor parallelism each rank reads only its slice of each sharded tensor (safetensors'
`get_slice`, so nothing else leaves the file); `distributed/shard.py` says which slice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from minisgl_mp.distributed.shard import TPShard
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.gguf import GGUFError, GGUFTensors, is_gguf


class WeightLoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter name
    part: str | None = None  # which part of a fused parameter (q, k, v, gate, up), or None
    expert: int | None = None  # which expert of a stacked expert parameter, or None

    @property
    def key(self) -> str:
        """Our name plus the slice it fills: each key must be filled exactly once."""
        return self.param + (f":{self.expert}" if self.expert is not None else "") + (
            f":{self.part}" if self.part else "")


# (pattern on the checkpoint name with "model." stripped, our name, group of the fused part,
# group of the expert index). Expert tensors come first: their names also end in *_proj.weight.
_RULES = [
    (re.compile(r"(layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up)_proj\.weight$"), r"\1gate_up_proj", 3, 2),
    (re.compile(r"(layers\.\d+\.mlp\.experts\.)(\d+)\.down_proj\.weight$"), r"\1down_proj", None, 2),
    (re.compile(r"(layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)$"), r"\1qkv_proj.\3", 2, None),
    (re.compile(r"(layers\.\d+\.mlp\.)(gate|up)_proj\.weight$"), r"\1gate_up_proj.weight", 2, None),
]
# Checkpoint tensors that carry nothing we need.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _is_experts(param: str) -> bool:
    return ".experts." in param


def _parts(param: str, shape: torch.Size, cfg: ModelConfig) -> list[tuple[str, int]]:
    """The fused parts of a parameter along its output rows, in order; [] when not fused."""
    if ".qkv_proj." in param:
        return [("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)]
    if param.endswith("gate_up_proj.weight") or param.endswith("experts.gate_up_proj"):
        half = shape[-2] // 2  # [2I, H], or [E, 2I, H] for experts
        return [("gate", half), ("up", half)]
    return []


def _map_name(ckpt_name: str) -> _Target | None:
    name = ckpt_name[len("model."):] if ckpt_name.startswith("model.") else ckpt_name
    for pattern, repl, part_group, expert_group in _RULES:
        m = pattern.search(name)
        if m:
            return _Target(pattern.sub(repl, name), m.group(part_group) if part_group else None,
                           int(m.group(expert_group)) if expert_group else None)
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


def _checkpoint_handles(weights: Path, cfg: ModelConfig) -> list[tuple[str, Callable[[], Any], list[str]]]:
    """(label for errors, opener of a `safe_open`-like handle, tensor names) per file of the
    checkpoint at `weights`: a folder of safetensors, or one GGUF file."""
    if is_gguf(weights):
        try:
            handle = GGUFTensors(weights, cfg.num_heads, cfg.num_kv_heads)
        except GGUFError as e:
            raise WeightLoadError(str(e)) from None
        return [(weights.name, lambda: handle, sorted(handle.keys()))]
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(weights).items():
        by_file.setdefault(file, []).append(name)
    out = []
    for file, names in sorted(by_file.items()):
        if not file.exists():
            raise WeightLoadError(f"checkpoint file {file} is listed in the index but missing")

        def opener(file: Path = file) -> Any:
            try:
                return safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:
                raise WeightLoadError(f"{file}: cannot open safetensors file: {e}") from e

        out.append((file.name, opener, sorted(names)))
    return out


def load_weights(model: nn.Module, cfg: ModelConfig, weights: Path, progress: bool = True,
                 shard: TPShard | None = None, int4_blocks: dict[str, torch.Tensor] | None = None) -> None:
    """Fill `model` from the checkpoint at `weights` (a folder of safetensors or a GGUF file).
    With `shard`, the model has `shard.rank_config(cfg)` shapes and gets this rank's slices;
    `cfg` is always the whole model's config. `int4_blocks` (a GGUF file, no shard): filled with
    the int4 blocks of each parameter the file holds as Q4_0 / Q4_1 in every part, by our name
    (models/weight_format.py stores them as they are)."""
    full_cfg = cfg
    cfg = shard.rank_config(full_cfg) if shard is not None else full_cfg
    params = dict(model.named_parameters())
    handles = _checkpoint_handles(weights, full_cfg)
    loaded: dict[str, str] = {}  # _Target.key -> checkpoint name
    parts_blocks: dict[str, dict[str | None, torch.Tensor | None]] = {}  # param -> part -> int4 blocks

    bar = tqdm(total=sum(len(names) for _, _, names in handles), desc="Loading weights", unit="tensor",
               disable=not progress)
    for label, opener, names in handles:
        with opener() as f:
            for ckpt_name in names:
                bar.update(1)
                if _IGNORED.search(ckpt_name) or (cfg.tie_word_embeddings and ckpt_name == "lm_head.weight"):
                    continue
                target = _map_name(ckpt_name)
                if target is None or target.param not in params:
                    raise WeightLoadError(f"unexpected tensor {ckpt_name!r} in {label}: the model has no such weight")
                try:
                    tensor = _read(f, ckpt_name, target, full_cfg, shard)
                except WeightLoadError as e:
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {label}: {e}") from None
                except Exception as e:
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {label} cannot be read: {e}") from e
                dest = _destination(params[target.param], target, cfg)
                if shard is not None and _is_vocab(target.param) and tensor.shape[0] < dest.shape[0]:
                    dest[tensor.shape[0]:].zero_()  # the last rank's padding rows
                    dest = dest[: tensor.shape[0]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise WeightLoadError(
                        f"tensor {ckpt_name!r} in {label} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                if not torch.isfinite(tensor).all():
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {label} contains NaN or inf")
                # A whole stacked tensor (transformers 5 can save experts as one [E, 2I, H]
                # tensor in our layout) fills every slice of it at once.
                keys = ([t.key for t in _targets_of(target.param, params[target.param], cfg)]
                        if target.part is None and target.expert is None else [target.key])
                if any(key in loaded for key in keys):
                    raise WeightLoadError(f"tensor {ckpt_name!r} in {label} is given twice")
                loaded.update(dict.fromkeys(keys, ckpt_name))
                dest.copy_(tensor)
                if int4_blocks is not None and shard is None and hasattr(f, "int4_blocks") and target.expert is None:
                    parts_blocks.setdefault(target.param, {})[target.part] = f.int4_blocks(ckpt_name)
    bar.close()
    for param, blocks in parts_blocks.items():
        order = [part for part, _ in _parts(param, params[param].shape, cfg)] or [None]
        if all(blocks.get(part) is not None for part in order):
            int4_blocks[param] = torch.cat([blocks[part] for part in order])

    missing = [_checkpoint_name(t) for t in _required_targets(params, cfg) if t.key not in loaded]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightLoadError(
            f"{len(missing)} tensor(s) missing from the checkpoint in {weights}: {shown}"
        )


def _is_vocab(param: str) -> bool:
    return param in ("embed_tokens.weight", "lm_head.weight")


def _shard_spec(target: _Target, cfg: ModelConfig, shard: TPShard) -> tuple[int, int, list[range]] | None:
    """(dim, the checkpoint tensor's full size along it, the ranges this rank reads, joined)
    for a sharded tensor; None for a replicated one (norms, the MoE router, o's bias)."""
    p, d = target.param, cfg.head_dim
    if ".qkv_proj." in p:
        if target.part == "q":
            heads, total = shard.q_heads(cfg), cfg.num_heads
        else:
            heads, total = shard.kv_heads(cfg), cfg.num_kv_heads
        return 0, total * d, [range(heads.start * d, heads.stop * d)]
    if p.endswith("o_proj.weight"):
        heads = shard.q_heads(cfg)
        return 1, cfg.num_heads * d, [range(heads.start * d, heads.stop * d)]
    if _is_experts(p):
        inter = cfg.moe_intermediate_size
        cols = shard.columns(inter)
        whole = target.expert is None  # one stacked [E, ...] tensor (transformers 5)
        if p.endswith("gate_up_proj"):
            if whole:
                return 1, 2 * inter, [cols, range(inter + cols.start, inter + cols.stop)]
            return 0, inter, [cols]
        return (2 if whole else 1), inter, [cols]
    if p.endswith("gate_up_proj.weight"):
        return 0, cfg.intermediate_size, [shard.columns(cfg.intermediate_size)]
    if p.endswith("down_proj.weight"):
        return 1, cfg.intermediate_size, [shard.columns(cfg.intermediate_size)]
    if _is_vocab(p):
        return 0, cfg.vocab_size, [shard.vocab_rows(cfg)]
    return None


def _read(f: object, name: str, target: _Target, cfg: ModelConfig, shard: TPShard | None) -> torch.Tensor:
    """The whole tensor, or this rank's slice of it (only those bytes are read)."""
    spec = None if shard is None or shard.size == 1 else _shard_spec(target, cfg, shard)
    if spec is None:
        return f.get_tensor(name)
    dim, full, ranges = spec
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if len(shape) <= dim or shape[dim] != full:
        raise WeightLoadError(f"has shape {shape}, expected {full} along dimension {dim}")
    lead = (slice(None),) * dim
    parts = [sl[lead + (slice(r.start, r.stop),)] for r in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _destination(param: torch.Tensor, target: _Target, cfg: ModelConfig) -> torch.Tensor:
    dest = param.data
    if target.expert is not None:
        if not _is_experts(target.param) or target.expert >= dest.shape[0]:
            raise WeightLoadError(f"expert {target.expert} of {target.param} is past the model's experts")
        dest = dest[target.expert]
    if target.part is None:
        return dest
    offset = 0
    for part, size in _parts(target.param, param.shape, cfg):
        if part == target.part:
            return dest.narrow(0, offset, size)
        offset += size
    raise WeightLoadError(f"unknown part {target.part!r} of {target.param}")


def _targets_of(name: str, p: torch.Tensor, cfg: ModelConfig) -> list[_Target]:
    """Every slice of parameter `name` that a checkpoint fills separately."""
    experts: list[int | None] = list(range(p.shape[0])) if _is_experts(name) else [None]
    parts: list[str | None] = [part for part, _ in _parts(name, p.shape, cfg)] or [None]
    return [_Target(name, part, e) for e in experts for part in parts]


def _required_targets(params: dict[str, torch.Tensor], cfg: ModelConfig) -> list[_Target]:
    return [t for name, p in params.items() if not (cfg.tie_word_embeddings and name == "lm_head.weight")
            for t in _targets_of(name, p, cfg)]


def _checkpoint_name(t: _Target) -> str:
    """The checkpoint's name for one of our targets, for error messages."""
    name = t.param
    if t.expert is not None:  # layers.0.mlp.experts.gate_up_proj -> layers.0.mlp.experts.3.gate_proj.weight
        prefix, _, kind = name.rpartition(".")
        name = f"{prefix}.{t.expert}.{t.part + '_proj' if t.part else kind}.weight"
    elif t.part:
        fused = "qkv_proj" if "qkv_proj" in name else "gate_up_proj"
        name = name.replace(fused, f"{t.part}_proj")
    return name if name.startswith("lm_head") else f"model.{name}"


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for a model of a real shape when no checkpoint is at hand (benchmarks)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * std)
