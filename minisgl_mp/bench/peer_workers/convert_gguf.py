"""llama.cpp's convert_hf_to_gguf.py on our checkpoints, with one mapping it lacks.

    python minisgl_mp/bench/peer_workers/convert_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype f32 --outfile OUT.gguf

The converter names a tokenizer's pre-tokenizer by hashing how it encodes a fixed text, and
refuses hashes it does not list. Our generated tokenizer (minisgl_mp.tools.make_tokenizer)
uses Qwen2's pre-tokenizer regex with a smaller vocabulary, so its hash is new; it is mapped to
`qwen2` here, at run time, rather than by editing or committing their code. Likewise the Qwen
converter tries a SentencePiece vocabulary first and imports sentencepiece before looking for
tokenizer.model; without that file (ours is a BPE tokenizer.json) it is told so up front, so
the converter needs no sentencepiece package to fall back to the BPE vocabulary.
"""

from __future__ import annotations

import importlib
import logging
import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "qwen2"


def patch(llama_cpp: Path) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    # Newer trees keep the model classes in conversion/; older ones in the script itself.
    try:
        base = importlib.import_module("conversion.base")
    except ImportError:
        base = importlib.import_module("convert_hf_to_gguf")
    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("convert_gguf").warning("unlisted pre-tokenizer hash: using %r", PRE_TOKENIZER)
            return PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    sentencepiece = base.TextModel._set_vocab_sentencepiece

    def set_vocab_sentencepiece(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not (Path(self.dir_model) / "tokenizer.model").is_file():
            raise FileNotFoundError(Path(self.dir_model) / "tokenizer.model")
        return sentencepiece(self, *args, **kwargs)

    base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    llama_cpp = Path(sys.argv[1]).resolve()
    patch(llama_cpp)
    sys.argv = [str(llama_cpp / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
