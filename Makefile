# Both entry points bootstrap their own virtualenv on a fresh machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= runs/demo

.PHONY: demo test lint typecheck docs docs-build bench clean test-containers

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# torch first and exactly: the local CPU wheel satisfies it; a looser pin pulls CUDA wheels.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev,tracking]"
	@# `flwr run .` on Flower's local simulation installs the app's dependencies into a fresh
	@# environment (offline: it hangs); the venv has them all (docs/how-to/flwr-run.md).
	@grep -q FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION $(BIN)/activate || printf '%s\n' \
	  '# fedsparse: `flwr run .` installs nothing (this venv holds every dependency)' \
	  'export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1' >> $(BIN)/activate
	@touch $(STAMP)

# The demo's folder is the demo's own: each `make demo` replaces the previous one (--overwrite).
demo: $(STAMP)
	$(BIN)/fedsparse demo --out $(DEMO_OUT) --overwrite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy sees the packages under their import names (fedsparse.common, ...) through a tree of
# symlinks: the source folders are mapped by setuptools' package-dir, which mypy cannot follow.
TYPECHECK := build/typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/fedsparse
	@for p in common client server lab; do ln -s $(CURDIR)/$$p $(TYPECHECK)/fedsparse/$$p; done
	@ln -s $(CURDIR)/protos/fedsparse/v1 $(TYPECHECK)/fedsparse/v1
	cd $(TYPECHECK) && $(abspath $(BIN))/mypy --config-file $(CURDIR)/pyproject.toml -p fedsparse

# The docs site (mkdocs.yml, docs/): `make docs` serves it on 127.0.0.1:8000; `make test`
# builds it with --strict (a broken link or a page missing from the nav fails) into build/.
# (not --quiet: it hides the warnings that --strict counts, and a broken link would pass)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

test: $(STAMP) lint typecheck docs-build
	$(BIN)/python -m pytest -q --durations=30

# Real containers (podman, root): TLS + SuperNode auth, 3 nodes vs a simulation. Not in `test`.
test-containers: $(STAMP)
	VENV=$(VENV) scripts/test-containers.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/masks.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/bytes.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
