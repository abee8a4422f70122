# Newcomer targets: `make serve` (install, build the default model, start the server)
# and `make test` (install, build the default model, run every test).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
MODEL_NAME ?= qwen3-tiny
MODEL_DIR := models/$(MODEL_NAME)
PYTEST_ARGS ?=

.PHONY: install model test test-fast serve bench clean

install: $(VENV)/.installed

# torch goes in first and pinned: an unpinned torch pulled in by another package would
# fetch a multi-GB CUDA build on machines where the CPU wheel is the one at hand.
$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

model: install $(MODEL_DIR)/model.safetensors

$(MODEL_DIR)/model.safetensors: configs/models/$(MODEL_NAME).json
	$(PYTHON) -m minisgl_mp.tools.make_model --config configs/models/$(MODEL_NAME).json --out $(MODEL_DIR)

test: install model
	$(PYTHON) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache .hypothesis
