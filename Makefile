# medsrl: `make help` lists the targets. `make train` and `make test` set themselves up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# A CPU-only laptop: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: help install train test lint tensorboard clean

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv with pinned torch (CPU build where there is no GPU) and medsrl

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[dev]"
	@$(BIN)/python -c "import torch; print('[medsrl] torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
	touch $(STAMP)

train: install ## Train the default (tiny preset, DAPO) on CPU; ARGS="..." adds Hydra overrides
	$(BIN)/medsrl-train $(ARGS)

test: install ## Run the whole test suite; PYTEST_ARGS="..." passes options to pytest
	$(BIN)/pytest -q $(PYTEST_ARGS)

lint: install ## Ruff over src, tests and benchmarks
	$(BIN)/ruff check src tests benchmarks

tensorboard: install ## TensorBoard over every run under logs/
	$(BIN)/tensorboard --logdir logs --bind_all

clean: ## Remove caches (keeps .venv, logs and data/cache)
	rm -rf .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
