"""Which weights the engine and the Hugging Face baselines load, so both run the same model.

A model with a checkpoint is loaded as is by both. A short name run with `--load-format
dummy` (e.g. Qwen3-0.6B: the real shape, no weights on disk) gets a random checkpoint written
once with `make_model.build_checkpoint`, which both then load; its config is the named one
with the default tokenizer's special ids (the builder refuses others), the shape unchanged.
Without that checkpoint (`write=False`), the engine runs its own dummy weights and the
baseline gets other random weights of the same shape: fine for speed, as runs ignore EOS.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_mp.models.source import ModelNotFoundError, default_tokenizer_dir, resolve_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchModel:
    engine_model: str  # what LLM(...) gets
    engine_load_format: str
    config_path: Path
    hf_weights_dir: Path | None  # a folder or a GGUF file; None: the baseline builds random weights from the config
    tokenizer_dir: Path | None
    note: str

    @property
    def same_weights(self) -> bool:
        return self.hf_weights_dir is not None

    def to_dict(self) -> dict[str, Any]:
        return {"engine_model": self.engine_model, "engine_load_format": self.engine_load_format,
                "config": str(self.config_path), "hf_weights": str(self.hf_weights_dir) if self.hf_weights_dir else None,
                "same_weights": self.same_weights, "note": self.note}


def _special_ids(tokenizer_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    from minisgl_mp.tools.make_tokenizer import ENDOFTEXT, IM_END

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    end, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    return {"bos_token_id": end, "eos_token_id": im_end, "pad_token_id": end}


def prepare_model(model: str, load_format: str | None, checkpoint_root: Path, seed: int,
                  write: bool = True) -> BenchModel:
    """load_format None: the checkpoint when one is found locally, else dummy weights."""
    from minisgl_mp.tools.make_model import build_checkpoint, checkpoint_is_current

    if load_format is None:
        try:
            resolve_model(model, "auto", allow_download=False)
            load_format = "auto"
        except ModelNotFoundError:
            load_format = "dummy"
    source = resolve_model(model, load_format, allow_download=False)
    tok = source.tokenizer_dir
    if source.weights is not None:
        return BenchModel(model, load_format, source.config_path, source.weights, tok,
                          f"checkpoint {source.weights}, loaded by both")
    # The config's own tokenizer when there is one (Qwen's for Qwen configs), so the benchmark
    # tokenizes as the real model does.
    tokenizer_dir = tok if tok is not None and (tok / "tokenizer.json").exists() else default_tokenizer_dir()
    if not write or tokenizer_dir is None:
        why = (" (--no-write-checkpoint)" if not write
               else " (no default tokenizer to build a checkpoint with: run `make model`)")
        return BenchModel(model, "dummy", source.config_path, None, tok,
                          f"engine: dummy weights; baseline: other random weights of the same shape{why}")
    config = json.loads(source.config_path.read_text(encoding="utf-8")) | _special_ids(tokenizer_dir)
    # Named by tokenizer too: a checkpoint written before Qwen configs had their own tokenizer
    # must not be taken for one with it.
    tok_tag = "" if tokenizer_dir == default_tokenizer_dir() else f"-{tokenizer_dir.name}"
    out = checkpoint_root / f"{Path(model).name}-seed{seed}{tok_tag}"
    if not checkpoint_is_current(out, config, seed=seed):
        logger.info("writing a random checkpoint of %s to %s (once)", source.config_path.name, out)
        print(f"writing a random {Path(model).name} checkpoint to {out} (reused by later runs)", flush=True)
        build_checkpoint(config, out, seed=seed, tokenizer_dir=tokenizer_dir)
    return BenchModel(str(out), "auto", out / "config.json", out, out,
                      f"random checkpoint of {source.config_path.name} at {out} (seed {seed}), loaded by both")
