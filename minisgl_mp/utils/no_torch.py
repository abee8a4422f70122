"""Keeps torch out of the tokenizer and detokenizer processes.

They only need tokenizers, and torch would cost them seconds of start-up, hundreds of MB and
threads that compete with the scheduler for cores. transformers checks `find_spec("torch")`,
which reports the module missing when sys.modules maps it to None.
"""

from __future__ import annotations

import os
import sys


def block_torch() -> None:
    if "torch" in sys.modules and sys.modules["torch"] is not None:
        return  # already imported in this process (e.g. a test): nothing to save
    sys.modules["torch"] = None  # type: ignore[assignment]
    # One thread for the Rust tokenizers library as well.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
