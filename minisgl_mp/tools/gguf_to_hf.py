"""Writes a GGUF file out as a Hugging Face checkpoint folder: config.json, the tokenizer files
and model.safetensors, every tensor dequantized to float32 (or --dtype).

The peers that load only safetensors (vLLM's CPU build, llama.cpp's own converter for its f32
and q8_0 files) then run the same weights as the engine does from the GGUF file.

    python -m minisgl_mp.tools.gguf_to_hf --gguf models/SmolLM2-135M-Instruct --out models/SmolLM2-135M-Instruct-f32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from minisgl_mp.models.gguf import GGUFTensors, find_gguf, is_gguf, prepare_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(gguf: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """`out`, written whole (a staging folder renamed at the end, so a reader never sees half)."""
    from safetensors.torch import save_file

    file = gguf if is_gguf(gguf) else find_gguf(gguf)
    if file is None:
        raise SystemExit(f"{gguf}: no GGUF file there")
    derived = prepare_gguf(file.resolve())
    config = json.loads((derived / "config.json").read_text(encoding="utf-8"))
    if "rope_freq_divisors" in config:
        raise SystemExit(f"{file}: its rope scaling is a table of divisors (rope_freqs), which a "
                         "transformers config cannot state")
    tensors = GGUFTensors(file, int(config["num_attention_heads"]), int(config["num_key_value_heads"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for f in derived.iterdir():
            if f.name != "source.json":
                shutil.copyfile(f, staging / f.name)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        state = {name: tensors.get_tensor(name).to(dtype) for name in tensors.keys()}
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.chmod(0o755)  # mkdtemp's 0700 is for the half-written folder only
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True, help="a GGUF file or a folder holding one")
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = ap.parse_args(argv)
    print(f"wrote {convert(args.gguf, args.out, DTYPES[args.dtype])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
