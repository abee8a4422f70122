"""Checkpoint loading and model resolution: sharded checkpoints load the same weights, damaged
ones fail with a WeightLoadError naming what is wrong and where, unknown names list every
place that was searched, and dummy weights need no checkpoint.

Damage is always done to a copy in tmp_path: fixture folders are shared by the whole session.
"""

from __future__ import annotations

import math
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import MakeCheckpoint, PagedModel, torch_threads
from minisgl_mp.attention.base import ForwardMode
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.loader import WeightLoadError
from minisgl_mp.models.registry import build_model
from minisgl_mp.models.source import CONFIGS_DIR, REPO_ROOT, ModelNotFoundError, ModelSource, resolve_model

SMALL = {"num_hidden_layers": 1}  # one layer: copies and loads stay cheap
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _load(model_dir: Path) -> torch.nn.Module:
    cfg = ModelConfig.from_file(model_dir / "config.json")
    source = ModelSource("test", model_dir / "config.json", model_dir, model_dir)
    return build_model(source, cfg, torch.float32, torch.device("cpu"), progress=False)


def _rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with `edit(tensors)` applied."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _load_error(model_dir: Path) -> str:
    with pytest.raises(WeightLoadError) as info:
        _load(model_dir)
    return str(info.value)


@pytest.fixture
def small_copy(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> Path:
    return _copy(make_checkpoint(SMALL), tmp_path / "model")


# ---- loading what is there ------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_sharded_checkpoint_gives_identical_logits(make_checkpoint: MakeCheckpoint) -> None:
    single, sharded = make_checkpoint(), make_checkpoint(shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    assert (sharded / "model.safetensors.index.json").exists()
    prompt = list(range(100, 140))
    a = PagedModel.load(single).run(ForwardMode.EXTEND, [0], [prompt])
    b = PagedModel.load(sharded).run(ForwardMode.EXTEND, [0], [prompt])
    assert torch.equal(a, b), f"sharded load changed logits by up to {float((a - b).abs().max()):.2e}"


@pytest.mark.timeout(60)
def test_untied_checkpoint_loads_its_own_lm_head(make_checkpoint: MakeCheckpoint) -> None:
    model = _load(make_checkpoint({**SMALL, "tie_word_embeddings": False}))
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    tied = _load(make_checkpoint(SMALL))
    assert tied.lm_head.weight is tied.embed_tokens.weight


# ---- damaged checkpoints -------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["garbage header", "truncated", "empty"])
def test_corrupted_file_names_the_file(small_copy: Path, damage: str) -> None:
    path = small_copy / WEIGHTS
    data = path.read_bytes()
    if damage == "garbage header":
        data = data[:8] + b"not json" * 4 + data[40:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = b""
    path.write_bytes(data)
    assert str(path) in _load_error(small_copy)


@pytest.mark.timeout(60)
def test_nan_in_a_tensor_names_the_tensor_and_the_file(small_copy: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(small_copy / WEIGHTS, lambda t: t[name].view(-1).__setitem__(7, float("nan")))
    msg = _load_error(small_copy)
    assert name in msg and WEIGHTS in msg and "NaN" in msg


@pytest.mark.timeout(60)
def test_corrupted_shard_names_that_shard(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    model_dir = _copy(make_checkpoint(SMALL, shards=3), tmp_path / "model")
    shard = sorted(model_dir.glob("*.safetensors"))[1]
    shard.write_bytes(b"\x00" * 16)
    assert shard.name in _load_error(model_dir)


@pytest.mark.timeout(60)
def test_missing_shard_file_names_it(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    model_dir = _copy(make_checkpoint(SMALL, shards=3), tmp_path / "model")
    shard = sorted(model_dir.glob("*.safetensors"))[2]
    shard.unlink()
    msg = _load_error(model_dir)
    assert shard.name in msg and "missing" in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.k_proj.weight",  # one part of a fused projection
    "model.layers.0.mlp.up_proj.weight",
    "model.norm.weight",
])
def test_missing_tensor_is_named(small_copy: Path, name: str) -> None:
    _rewrite(small_copy / WEIGHTS, lambda t: t.pop(name))
    msg = _load_error(small_copy)
    assert name in msg and "missing" in msg and str(small_copy) in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch, name", [
    ("qwen3_moe", "model.layers.0.mlp.experts.5.up_proj.weight"),  # one part of one expert
    ("qwen3_moe", "model.layers.0.mlp.experts.7.down_proj.weight"),
    ("qwen3_moe", "model.layers.0.mlp.gate.weight"),  # the router
    ("qwen2", "model.layers.0.self_attn.v_proj.bias"),
])
def test_missing_tensor_of_other_architectures_is_named(make_checkpoint: MakeCheckpoint, tmp_path: Path,
                                                        arch: str, name: str) -> None:
    model_dir = _copy(make_checkpoint(SMALL, arch=arch), tmp_path / "model")
    _rewrite(model_dir / WEIGHTS, lambda t: t.pop(name))
    msg = _load_error(model_dir)
    assert name in msg and "missing" in msg


@pytest.mark.timeout(60)
def test_expert_past_the_configured_count_is_refused(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    model_dir = _copy(make_checkpoint(SMALL, arch="qwen3_moe"), tmp_path / "model")
    name = "model.layers.0.mlp.experts.8.down_proj.weight"  # experts 0-7
    _rewrite(model_dir / WEIGHTS, lambda t: t.__setitem__(name, t["model.layers.0.mlp.experts.0.down_proj.weight"].clone()))
    assert "expert 8" in _load_error(model_dir)


@pytest.mark.timeout(60)
def test_untied_checkpoint_without_lm_head_is_refused(make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    model_dir = _copy(make_checkpoint({**SMALL, "tie_word_embeddings": False}), tmp_path / "model")
    _rewrite(model_dir / WEIGHTS, lambda t: t.pop("lm_head.weight"))
    assert "'lm_head.weight'" in _load_error(model_dir)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.q_norm.weight", (32,)),
    ("model.layers.0.self_attn.v_proj.weight", (64, 256)),
    ("model.embed_tokens.weight", (8000, 256)),
])
def test_wrongly_shaped_tensor_names_tensor_file_and_shapes(small_copy: Path, name: str, shape) -> None:
    _rewrite(small_copy / WEIGHTS, lambda t: t.__setitem__(name, torch.zeros(shape)))
    msg = _load_error(small_copy)
    assert name in msg and WEIGHTS in msg and str(tuple(shape)) in msg


@pytest.mark.timeout(60)
def test_unexpected_tensor_is_named(small_copy: Path) -> None:
    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(small_copy / WEIGHTS, lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    msg = _load_error(small_copy)
    assert name in msg and WEIGHTS in msg and "unexpected" in msg


@pytest.mark.timeout(60)
def test_pickle_checkpoint_is_refused_without_unpickling(small_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"

    class RunsCodeWhenLoaded:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (small_copy / WEIGHTS).unlink()
    (small_copy / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": RunsCodeWhenLoaded()}))
    msg = _load_error(small_copy)
    assert "pytorch_model.bin" in msg and "pickle" in msg and str(small_copy) in msg
    assert not marker.exists(), "the loader unpickled an untrusted .bin file"


# ---- finding models -----------------------------------------------------------------------------

@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No network, an empty Hugging Face cache, and a working directory without models/."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_unknown_model_names_every_place_searched(offline_hub: Path, load_format: str) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model-7", load_format=load_format)
    msg = str(info.value)
    assert "'no-such-model-7'" in msg
    assert "no-such-model-7: no such folder" in msg
    for models_dir in (offline_hub / "models", REPO_ROOT / "models"):
        assert str(models_dir.resolve() / "no-such-model-7") in msg
    assert "Hugging Face cache: no snapshot of Qwen/no-such-model-7" in msg
    assert "Hugging Face hub Qwen/no-such-model-7" in msg
    if load_format == "dummy":
        assert str(CONFIGS_DIR / "no-such-model-7.json") in msg


@pytest.mark.timeout(60)
def test_folder_without_config_is_reported(offline_hub: Path) -> None:
    (offline_hub / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="a folder without config.json"):
        resolve_model(str(offline_hub / "empty"), allow_download=False)


@pytest.mark.timeout(60)
def test_dummy_load_of_a_known_config_needs_no_weights(offline_hub: Path) -> None:
    source = resolve_model("Qwen3-0.6B", load_format="dummy")
    assert source.weights is None
    if not (REPO_ROOT / "models" / "Qwen3-0.6B").exists():  # a downloaded copy's config wins
        assert source.config_path == CONFIGS_DIR / "Qwen3-0.6B.json"
    cfg = ModelConfig.from_file(source.config_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (28, 1024, 16, 8)
    assert source.tokenizer_dir is not None and (source.tokenizer_dir / "tokenizer.json").exists()


@pytest.mark.timeout(60)
def test_local_folder_resolves_with_its_weights(tiny_model_dir: Path) -> None:
    source = resolve_model(str(tiny_model_dir))
    assert source.weights == tiny_model_dir.resolve()
    assert source.config_path == tiny_model_dir.resolve() / "config.json"
    assert resolve_model(str(tiny_model_dir), load_format="dummy").weights is None


@pytest.mark.timeout(60)
def test_dummy_weights_are_seeded_and_usable() -> None:
    cfg_path = CONFIGS_DIR / "qwen3-tiny.json"
    cfg = ModelConfig.from_file(cfg_path)
    source = ModelSource("qwen3-tiny", cfg_path, None, None)

    def logits(seed: int) -> torch.Tensor:
        model = build_model(source, cfg, torch.float32, torch.device("cpu"), progress=False, seed=seed)
        return PagedModel(model).run(ForwardMode.EXTEND, [0], [list(range(100, 120))])

    a, b, c = logits(0), logits(0), logits(1)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), "the same seed gave different dummy weights"
    assert not torch.equal(a, c), "different seeds gave the same dummy weights"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config_path", sorted(CONFIGS_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_config_builds_with_the_checkpoint_parameter_count(config_path: Path) -> None:
    # On the meta device: the shape of Qwen3-30B-A3B without its 61 GB.
    import json

    from minisgl_mp.models.registry import model_class
    from minisgl_mp.tools.make_model import ModelShape

    cfg = ModelConfig.from_file(config_path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    ours = sum(p.numel() for p in model.parameters())
    shapes = ModelShape.from_config(json.loads(config_path.read_text()))
    assert ours == sum(math.prod(dims) for dims in shapes.tensor_shapes().values())


@pytest.mark.timeout(60)
def test_experts_stacked_in_one_tensor_load_like_per_expert_ones(make_checkpoint: MakeCheckpoint,
                                                                  tmp_path: Path) -> None:
    per_expert = make_checkpoint(SMALL, arch="qwen3_moe")
    stacked = _copy(per_expert, tmp_path / "model")

    def stack(t: dict[str, torch.Tensor]) -> None:
        p = "model.layers.0.mlp.experts."
        n = sum(1 for k in t if k.startswith(p) and k.endswith("down_proj.weight"))
        t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"),
                                                        t.pop(f"{p}{e}.up_proj.weight")]) for e in range(n)])
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(n)])

    _rewrite(stacked / WEIGHTS, stack)
    a, b = _load(per_expert).state_dict(), _load(stacked).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
