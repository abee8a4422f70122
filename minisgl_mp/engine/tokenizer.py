"""Loading a Hugging Face tokenizer. Torch-free: the tokenizer and detokenizer processes use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path | str | None) -> Any | None:
    """The tokenizer in `path`, or None when there is none there."""
    if path is None or not any((Path(path) / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
