"""Builds a random checkpoint (Llama, Qwen2, Qwen3 or Qwen3-MoE), offline and deterministic, in
Hugging Face's layout.

    python -m minisgl_mp.tools.make_model --config configs/models/qwen3-tiny.json \
        --out models/qwen3-tiny [--seed 0] [--shards 1]
    python -m minisgl_mp.tools.make_model --arch llama --out models/llama-tiny   # qwen3-tiny's size

The folder holds config.json, generation_config.json, model.safetensors (or HF-style shards
plus model.safetensors.index.json) and a byte-level BPE tokenizer trained on text that ships
with Python, so it loads like Qwen/Qwen3-0.6B through the same code path. `--arch` turns the config into another
architecture of the same size (for qwen3_moe: 8 experts, top 2, a quarter of the MLP width each). It is built in a
temporary folder beside the target and renamed into place, so a half-written model is never
visible under the target name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from minisgl_mp.models.config import ModelConfig
from minisgl_mp.utils.files import replace_dir
from minisgl_mp.tools.make_tokenizer import (
    TOKENIZER_FILES, check_special_ids, generation_config, tokenizer_config, train_tokenizer,
)

# Bumped whenever the same config and seed would produce different files.
BUILDER_VERSION = "3"

# Weight init. A 0.02-std model predicts its own input token (tied embeddings and a residual
# stream dominated by the embedding), so greedy output repeats one token. Projections get
# std = MATRIX_GAIN / sqrt(fan_in), which lets the layers dominate the residual at any width;
# embeddings get std = LOGIT_STD / sqrt(hidden), so logits have std ~LOGIT_STD. Measured on
# qwen3-tiny: gain 1 repeats one token, 2-8 gives varied output. Float32 differences between
# two correct implementations grow with the logit scale (~1.5e-6 of max |logit|), so LOGIT_STD
# stays modest: 6 gives max |logit| ~30 (like real models) and a median top-2 gap ~1.
MATRIX_GAIN = 3.0
LOGIT_STD = 6.0
NORM_NOISE = 0.1  # norm weights are 1 + N(0, NORM_NOISE) so no two channels are identical
# Without Qwen3's q/k norms, MATRIX_GAIN on q and k gives attention scores of std ~9: softmax so
# sharp that float32 rounding alone (HF's own float32 against its float64) moves logits ~4e-4.
# QK_GAIN gives q and k unit scale, as the norms do for Qwen3.
QK_GAIN = 1.0
QK_PROJ = re.compile(r"self_attn\.[qk]_proj\.weight$")
# Mixture of experts: a token's output moves with its routing weights, so rounding in the router
# logits reaches the logits multiplied by the gap between expert outputs. At MATRIX_GAIN for
# both, HF's own float32 logits were 2.9e-4 from its float64 ones; these gains bring that to ~5e-5.
ROUTER_GAIN = 0.5
EXPERT_GAIN = 2.0
BIAS_STD = 0.5  # q/k/v biases (Qwen2): large enough that a model ignoring them fails the HF checks

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-tiny.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --arch name -> (model_type, architectures[0]) of the Hugging Face config.
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# What --arch qwen3_moe adds to a dense config that has no experts of its own: 8 small experts,
# top 2, every layer sparse, so tokens spread over several experts even in short tests.
MOE_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def arch_config(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """`config` as a checkpoint of another architecture of the same size."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    model_type, architecture = ARCHS[arch]
    out = config | {"model_type": model_type, "architectures": [architecture]}
    if arch == "qwen3_moe":
        moe = MOE_DEFAULTS | {"moe_intermediate_size": max(1, config["intermediate_size"] // 4)}
        out = moe | out
    else:
        for key in [*MOE_DEFAULTS, "moe_intermediate_size"]:
            out.pop(key, None)
    return out


@dataclass(frozen=True)
class ModelShape:
    """The parts of a config.json that decide tensor names and shapes."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    dtype: torch.dtype
    attention_bias: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        by_type = {model_type: (arch, architecture) for arch, (model_type, architecture) in ARCHS.items()}
        model_type = config.get("model_type")
        if model_type not in by_type or config.get("architectures") != [by_type[model_type][1]]:
            raise ValueError("config must have a model_type and architectures of: " + ", ".join(
                f"{t} [{a}]" for t, (_, a) in sorted(by_type.items())))
        dtype_name = config.get("torch_dtype", config.get("dtype", "float32"))
        if dtype_name not in DTYPES:
            raise ValueError(f"unsupported torch_dtype {dtype_name!r}; expected one of {sorted(DTYPES)}")
        try:
            cfg = ModelConfig.from_dict(config)
            return cls(
                arch=by_type[model_type][0],
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=config["num_attention_heads"],
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
                vocab_size=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)),
                dtype=DTYPES[dtype_name],
                attention_bias=cfg.attention_bias,
                num_experts=cfg.num_experts,
                moe_intermediate_size=cfg.moe_intermediate_size,
                sparse_layers=tuple(i for i in range(cfg.num_layers) if cfg.is_sparse_layer(i)),
            )
        except KeyError as missing:
            raise ValueError(f"config lacks {missing}") from None

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face state-dict names (as checkpoints store them) -> shapes; Linear weights are [out, in]."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = self.arch == "qwen2" or self.attention_bias
        o_bias = self.arch != "qwen2" and self.attention_bias
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
            if qkv_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}  # fmt: skip
            if o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (self.head_dim,),
                           p + "self_attn.k_norm.weight": (self.head_dim,)}  # fmt: skip
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if i in self.sparse_layers:
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
                inter = self.moe_intermediate_size
                for e in range(self.num_experts):
                    shapes |= {
                        p + f"mlp.experts.{e}.gate_proj.weight": (inter, h),
                        p + f"mlp.experts.{e}.up_proj.weight": (inter, h),
                        p + f"mlp.experts.{e}.down_proj.weight": (h, inter),
                    }
            else:
                shapes |= {
                    p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                    p + "mlp.up_proj.weight": (self.intermediate_size, h),
                    p + "mlp.down_proj.weight": (h, self.intermediate_size),
                }
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def random_weights(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    # Each tensor has its own generator seeded from (seed, name), so a tensor's values do not
    # depend on the other tensors: adding layers or sharding leaves the rest unchanged.
    weights = {}
    for name, dims in shape.tensor_shapes().items():
        digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        noise = torch.randn(dims, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensor = 1.0 + NORM_NOISE * noise
        elif name.endswith(".bias"):
            tensor = BIAS_STD * noise
        elif name.endswith("mlp.gate.weight"):
            tensor = noise * (ROUTER_GAIN / math.sqrt(dims[1]))
        elif ".experts." in name:
            tensor = noise * (EXPERT_GAIN / math.sqrt(dims[1]))
        elif not shape.qk_norm and QK_PROJ.search(name):
            tensor = noise * (QK_GAIN / math.sqrt(dims[1]))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = noise * (LOGIT_STD / math.sqrt(shape.hidden_size))
        else:
            tensor = noise * (MATRIX_GAIN / math.sqrt(dims[1]))
        weights[name] = tensor.to(shape.dtype).contiguous()
    return weights


def split_into_shards(tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Contiguous groups of tensor names of roughly equal bytes; every group is non-empty."""
    names = list(tensors)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"shards must be between 1 and {len(names)} (the tensor count), got {num_shards}")
    bytes_left = sum(t.nbytes for t in tensors.values())
    budget = bytes_left / num_shards  # re-split after each group, so one huge tensor is absorbed
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for index, name in enumerate(names):
        groups_to_open = num_shards - len(groups)
        must_close = len(names) - index == groups_to_open  # one tensor left per remaining group
        nbytes = tensors[name].nbytes
        if groups_to_open and groups[-1] and (must_close or group_bytes + nbytes / 2 > budget):
            groups.append([])
            group_bytes = 0
            budget = bytes_left / groups_to_open
        groups[-1].append(name)
        group_bytes += nbytes
        bytes_left -= nbytes
    return groups


def write_weights(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if num_shards == 1:
        save_file(tensors, out / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    for index, names in enumerate(split_into_shards(tensors, num_shards), start=1):
        filename = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names}, out / filename, metadata=metadata)
        weight_map |= dict.fromkeys(names, filename)
    index_json = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json(out / "model.safetensors.index.json", index_json)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_checkpoint(
    config: dict[str, Any],
    out_dir: str | Path,
    *,
    seed: int = 0,
    shards: int = 1,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Writes a complete checkpoint to out_dir (replacing one already there) and returns its path.

    tokenizer_dir: a folder holding a tokenizer this builder wrote before (e.g. another
    checkpoint) or Qwen's (tools/qwen_tokenizer); its files are copied instead of training the
    tokenizer again.
    """
    shape = ModelShape.from_config(config)
    if tokenizer_dir is None:
        tokenizer = train_tokenizer()
    else:
        tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    check_special_ids(config, tokenizer)
    weights = random_weights(shape, seed)

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        staging.chmod(0o755)
        write_json(staging / "config.json", config)
        write_json(staging / "generation_config.json", generation_config(tokenizer))
        if tokenizer_dir is None:
            tokenizer.save(str(staging / "tokenizer.json"))
            tokenizer.model.save(str(staging))  # vocab.json + merges.txt, as Qwen ships them
        else:
            for name in TOKENIZER_FILES:
                shutil.copyfile(Path(tokenizer_dir) / name, staging / name)
        max_len = int(config.get("max_position_embeddings", 4096))
        source_config = None if tokenizer_dir is None else Path(tokenizer_dir) / "tokenizer_config.json"
        if source_config is not None and source_config.is_file():
            # The reused tokenizer's own added tokens and chat template (e.g. Qwen's real one).
            tok_config = json.loads(source_config.read_text(encoding="utf-8")) | {"model_max_length": max_len}
        else:
            tok_config = tokenizer_config(tokenizer, max_len)
        write_json(staging / "tokenizer_config.json", tok_config)
        write_weights(weights, staging, shards)
        # Kept out of the safetensors header: safetensors writes its metadata in hash order,
        # which would make two identical builds differ byte-wise.
        write_json(staging / "build_info.json", build_info(seed, shards))
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes 0600
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def build_info(seed: int, shards: int) -> dict[str, Any]:
    return {"builder": "minisgl_mp.tools.make_model", "version": BUILDER_VERSION, "seed": seed,
            "shards": shards}  # fmt: skip


def checkpoint_is_current(out_dir: str | Path, config: dict[str, Any], *, seed: int = 0) -> bool:
    """True when out_dir holds a single-file checkpoint this builder version made from config and seed."""
    out = Path(out_dir)
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
              "build_info.json")  # fmt: skip
    if not all((out / name).is_file() for name in needed):
        return False
    if json.loads((out / "config.json").read_text(encoding="utf-8")) != config:
        return False
    return json.loads((out / "build_info.json").read_text(encoding="utf-8")) == build_info(seed, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a config.json (default: %(default)s)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default=None,
                        help="build this architecture at the config's size (default: the config's own)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to (re)write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="safetensors files to split the weights into")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="reuse this folder's tokenizer")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    config = json.loads(args.config.read_text(encoding="utf-8"))
    try:
        if args.arch is not None:
            config = arch_config(config, args.arch)
        out = build_checkpoint(
            config, args.out, seed=args.seed, shards=args.shards, tokenizer_dir=args.tokenizer_dir
        )
    except ValueError as error:
        print(f"make_model: {error}", file=sys.stderr)
        return 2
    params = sum(math.prod(dims) for dims in ModelShape.from_config(config).tensor_shapes().values())
    size = sum(f.stat().st_size for f in out.iterdir())
    seconds = time.perf_counter() - start
    print(f"wrote {out}: {params / 1e6:.1f}M parameters, {size / 2**20:.1f} MiB, {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
