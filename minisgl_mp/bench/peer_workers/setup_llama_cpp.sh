#!/usr/bin/env bash
# Builds llama.cpp from the sources vendored in PyPI's `llama-cpp-python` sdist (PyPI is the
# only registry reachable here; only it from source, so its build tools come as wheels), Release, tuned to this CPU (GGML_NATIVE).
# Usage: minisgl_mp/bench/peer_workers/setup_llama_cpp.sh [DIR] (default .peers).
set -euo pipefail
PEERS=${1:-.peers}
PY=${PY:-python3}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$PEERS/src"
if ! ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp >/dev/null 2>&1; then
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$PEERS/src" llama-cpp-python
    tar -xzf "$PEERS"/src/llama_cpp_python-*.tar.gz -C "$PEERS/src"
fi
SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)
ln -sfn "$(cd "$SRC" && pwd)" "$PEERS/llama.cpp"
cmake -S "$SRC" -B "$PEERS/llama-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$PEERS/llama-build" -j "$JOBS" --target llama-batched-bench llama-bench
ls -l "$PEERS/llama-build/bin"
