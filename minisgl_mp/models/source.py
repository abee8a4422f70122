"""Finds a model from what the user typed: a folder, a GGUF file (or a folder holding one), a
Hugging Face hub id, or a short name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minisgl_mp.models.gguf import find_gguf, is_gguf, prepare_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs" / "models"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user typed; served as the model id
    config_path: Path
    weights: Path | None  # a folder of safetensors or a GGUF file; None: random weights (--load-format dummy)
    tokenizer_dir: Path | None


def _models_dirs() -> list[Path]:
    dirs = [Path.cwd() / "models", REPO_ROOT / "models"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def _hub_ids(model: str) -> list[str]:
    if "/" in model:
        return [model]
    return [f"meta-llama/{model}"] if model.lower().startswith("llama-") else [f"Qwen/{model}"]


def _from_hf_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_PATTERNS))
    except Exception:
        return None
    return path if (path / "config.json").exists() else None


def default_tokenizer_dir() -> Path | None:
    """The generated default model's tokenizer, used by dummy-weight models without one."""
    for d in _models_dirs():
        if (d / "qwen3-tiny" / "tokenizer.json").exists():
            return d / "qwen3-tiny"
    return None


# Configs whose checkpoints ship Qwen's tokenizer (151,643 BPE tokens and the added ones after).
_QWEN_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_QWEN_VOCAB_MIN = 151669


def dummy_tokenizer_dir(config_path: Path) -> Path | None:
    """The tokenizer for a dummy-weight model from configs/models/: Qwen's real one (built
    offline on first use) for a Qwen config, else the generated default model's."""
    import json

    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    if cfg.get("model_type") in _QWEN_MODEL_TYPES and int(cfg.get("vocab_size", 0)) >= _QWEN_VOCAB_MIN:
        from minisgl_mp.tools.qwen_tokenizer import cached_tokenizer_dir

        return cached_tokenizer_dir()
    return default_tokenizer_dir()


def resolve_model(model: str, load_format: str = "auto", tokenizer: str | None = None,
                  allow_download: bool = True) -> ModelSource:
    tried: list[str] = []

    def found(folder: Path) -> ModelSource:
        tok = Path(tokenizer) if tokenizer else folder
        weights = None if load_format == "dummy" else folder
        return ModelSource(model, folder / "config.json", weights, tok)

    def found_gguf(file: Path) -> ModelSource:
        # The config and tokenizer come from the file's metadata, written once beside it in the cache.
        derived = prepare_gguf(file.resolve(), need_tokenizer=not tokenizer)
        tok = Path(tokenizer) if tokenizer else derived
        weights = None if load_format == "dummy" else file.resolve()
        return ModelSource(model, derived / "config.json", weights, tok)

    local = Path(model).expanduser()
    if local.is_file() and is_gguf(local):
        return found_gguf(local)
    if local.is_dir():
        if (local / "config.json").exists():
            return found(local.resolve())
        if (gguf := find_gguf(local)) is not None:
            return found_gguf(gguf)
        tried.append(f"{local}: a folder without config.json or a GGUF file")
    else:
        tried.append(f"{local}: no such folder or GGUF file")

    short = model.rstrip("/").split("/")[-1]
    for d in _models_dirs():
        if (d / short / "config.json").exists():
            return found(d / short)
        if (d / short).is_dir() and (gguf := find_gguf(d / short)) is not None:
            return found_gguf(gguf)
        tried.append(f"{d / short}: not there")

    for repo_id in _hub_ids(model):
        path = _from_hf_cache(repo_id)
        if path is not None:
            return found(path)
        tried.append(f"Hugging Face cache: no snapshot of {repo_id}")

    if load_format == "dummy":
        cfg = CONFIGS_DIR / f"{short}.json"
        if cfg.exists():
            tok = Path(tokenizer) if tokenizer else dummy_tokenizer_dir(cfg)
            return ModelSource(model, cfg, None, tok)
        tried.append(f"{cfg}: no such config")

    if allow_download:
        for repo_id in _hub_ids(model):
            try:
                from huggingface_hub import snapshot_download

                path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
                return found(path)
            except Exception as e:  # offline, unknown repo, gated repo ...
                tried.append(f"Hugging Face hub {repo_id}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    raise ModelNotFoundError(f"model {model!r} not found; looked in:\n  " + "\n  ".join(tried))
