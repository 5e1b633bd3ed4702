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

.PHONY: setup setup-dev demo test test-fast bench bench-gpu gpu-wheels clean

setup: $(STAMP)
	@scripts/setup-system.sh

setup-dev: $(DEV_STAMP)
	@scripts/setup-system.sh --dev

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $@

$(DEV_STAMP): requirements-dev.txt requirements-store.txt $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@touch $@

demo: setup
	$(BIN)/textsql demo --run-dir runs/demo

# The tests build DeepSpeed's CPU ops into this checkout's own cache: a build interrupted elsewhere (its lock left
# behind) or another checkout's paths (a rebuild each time the two alternate) never reach a test run.
test test-fast: export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

# Two pytest-xdist workers: a real test spends much of its time waiting (sshd, a kernel, a timeout), which the other
# worker fills. tests/helpers/scheduling.py keeps a module, and the tests reading the docs' runs, on one worker.
TEST_WORKERS ?= 2

test: setup-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-fast: setup-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not slow"

bench: setup
	$(BIN)/python -m bench

# The short GPU comparison (bench/gpu_quick.py), sized for bench/device.sh's 9 minutes: bench/gpu_quick.json, a table.
bench-gpu: setup
	$(BIN)/python -m bench gpu-quick

# What bench/device.sh installs on a GPU machine without network, downloaded here (bench/gpu-wheels.txt) for the
# Pythons it may have: copy bench/wheels/ (kept under 64 MiB) there with the tree. Never torch: the machine's stays.
GPU_WHEELS := bench/wheels
GPU_PYTHONS := 3.11 3.12
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux_2_5_x86_64 manylinux1_x86_64
GPU_WHEELS_MAX_MIB := 64

gpu-wheels: setup
	@mkdir -p $(GPU_WHEELS)
	cd bench && for version in $(GPU_PYTHONS); do \
		DS_BUILD_OPS=0 $(abspath $(BIN))/python -m pip download -q --no-deps --no-build-isolation --only-binary=:all: \
			--no-binary=deepspeed --python-version $$version $(addprefix --platform ,$(GPU_PLATFORMS)) \
			-d $(abspath $(GPU_WHEELS)) -r gpu-wheels.txt || exit 1; \
	done
	@size=$$(du -sm $(GPU_WHEELS) | cut -f1); ls $(GPU_WHEELS) | wc -l | xargs echo "$(GPU_WHEELS): $$size MiB, files:"; \
	test $$size -lt $(GPU_WHEELS_MAX_MIB) || { echo "$(GPU_WHEELS) is $$size MiB, over the $(GPU_WHEELS_MAX_MIB) MiB a copy to a GPU machine without network should carry: drop a Python from GPU_PYTHONS"; exit 1; }

clean:
	rm -rf runs .pytest_cache

# The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8000, rebuilt on every save.
.PHONY: docs
docs: $(DEV_STAMP)
	$(BIN)/mkdocs serve
