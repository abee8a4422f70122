"""Shared fixtures: the generated default checkpoint, small checkpoints of other shapes, --run-slow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO_ROOT / "configs" / "models" / "qwen3-tiny.json"
TINY_MODEL_DIR = REPO_ROOT / "models" / "qwen3-tiny"

# make_checkpoint(overrides=None, *, seed=0, shards=1, arch="qwen3") -> Path of a checkpoint built
# from qwen3-tiny's config as architecture `arch` (make_model's --arch), updated with `overrides`,
# reusing the default model's tokenizer. Equal
# arguments return the same folder for the whole session, so tests must not modify it.
MakeCheckpoint = Callable[..., Path]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def read_tiny_config() -> dict[str, Any]:
    return json.loads(TINY_CONFIG.read_text(encoding="utf-8"))


@pytest.fixture
def tiny_config() -> dict[str, Any]:
    """configs/models/qwen3-tiny.json, a fresh copy per test."""
    return read_tiny_config()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """models/qwen3-tiny, (re)built when missing or made from another config or builder version."""
    # Imported here, not at the top: this conftest loads for torch-free tests too.
    from filelock import FileLock

    from minisgl_mp.tools.make_model import build_checkpoint, checkpoint_is_current

    config = read_tiny_config()
    TINY_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    # The lock keeps concurrent pytest runs from building it twice; the builder's rename
    # already keeps readers from seeing a half-written model.
    with FileLock(str(TINY_MODEL_DIR.parent / f".{TINY_MODEL_DIR.name}.lock")):
        if not checkpoint_is_current(TINY_MODEL_DIR, config):
            build_checkpoint(config, TINY_MODEL_DIR)
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_model_dir: Path) -> Path:
    """The folder with the generated tokenizer's files (the default model's)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> MakeCheckpoint:
    from minisgl_mp.tools.make_model import arch_config, build_checkpoint

    built: dict[str, Path] = {}

    def make(overrides: dict[str, Any] | None = None, *, seed: int = 0, shards: int = 1,
             arch: str = "qwen3") -> Path:
        config = arch_config(read_tiny_config(), arch) | (overrides or {})
        key = json.dumps([config, seed, shards], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp("checkpoint") / "model"
            built[key] = build_checkpoint(config, out, seed=seed, shards=shards, tokenizer_dir=tokenizer_dir)
        return built[key]

    return make
