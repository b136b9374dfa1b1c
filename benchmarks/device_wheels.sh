#!/usr/bin/env bash
# The wheels a bare GPU image (torch 2.11, transformers 5.17, lightning 2.6.6, no hydra, hdbscan,
# math-verify, pydantic or vllm) lacks to run benchmarks/gpu_smoke.py, for Python 3.12, into .whl/ (ignored
# by git). On the device (docs/GPU.md, "The GPU smoke run"):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
# torch stays the image's (a CUDA torch wheel is far over what a call may carry) and vLLM is not
# carried (about 400 MB): the smoke run there uses HF generate (--backend hf). huggingface_hub stays
# the image's 1.33 (the lock's transformers 5.19 takes >= 1.31; the lock's hub 2.4 would need httpx2 too).
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions of requirements/lock.txt, the ones the suite runs
pinned() { for name in "$@"; do grep -i -E "^${name}==" requirements/lock.txt; done; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d .whl \
  $(pinned hydra-core omegaconf hdbscan math-verify latex2sympy2_extended transformers tokenizers \
    pydantic pydantic_core annotated-types typing-inspection)
# omegaconf's parser runtime is published as a source archive only: built here (pure Python)
python3 -m pip wheel -q --no-deps -w .whl $(pinned antlr4-python3-runtime)
ls -la .whl
