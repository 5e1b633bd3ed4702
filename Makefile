# The README's two commands are `make demo` and `make test`; both set up what they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
# The venv's tools come first for everything make runs, ranks on local worker pods included: one
# ninja (the pinned one) builds DeepSpeed's ops, so the cached build is never invalidated by another.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test bench clean

setup: $(STAMP)
	@scripts/setup-system.sh

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $@

demo: setup
	$(BIN)/textsql demo --out runs/demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf runs .pytest_cache
