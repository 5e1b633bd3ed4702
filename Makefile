# The README's two commands are `make demo` and `make test`; both set up what they need first.
# `make test-fast` is a contributor's loop: the tests not marked `slow` (no launches, sshd, browser or kernel).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per requirements file: `make demo` installs only the runtime, `make test` the dev tools on top.
STAMP := $(VENV)/.setup-stamp
DEV_STAMP := $(VENV)/.setup-dev-stamp
# The venv's tools come first for everything make runs, ranks on local worker pods included: one
# ninja (the pinned one) builds DeepSpeed's ops, so the cached build is never invalidated by another.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup setup-dev demo test test-fast bench clean

setup: $(STAMP)
	@scripts/setup-system.sh

setup-dev: $(DEV_STAMP)
	@scripts/setup-system.sh --dev

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $@

$(DEV_STAMP): requirements-dev.txt $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@touch $@

demo: setup
	$(BIN)/textsql demo --out runs/demo

test: setup-dev
	$(BIN)/python -m pytest

test-fast: setup-dev
	$(BIN)/python -m pytest -m "not slow"

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf runs .pytest_cache

# The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8000, rebuilt on every save.
.PHONY: docs
docs: $(DEV_STAMP)
	$(BIN)/mkdocs serve
