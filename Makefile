# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-cpus lint typecheck unit clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,tensorboard,report,serve]'
	touch $(STAMP)

# The main job on the built-in example: train it (logs and report under runs/), then measure the Plan
# auto chose against the naive loop, side by side, ending with the speed-up and the report's path.
# 20 epochs (460 steps) repay auto's whole precision trial (34 steps at most, a tenth of the run); the
# task's own 15 (345 steps) would too, with little to spare, and a run under 260 steps gets none.
RUN_DIR = runs/digits-$(shell date +%Y%m%d-%H%M%S)
run: $(STAMP)
	$(eval DIR := $(RUN_DIR))
	$(BIN)/redline train --task example:digits --epochs 20 --out $(DIR)
	$(BIN)/redline report $(DIR)
	$(BIN)/redline bench --task example:digits --html $(DIR)/bench.html

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -n auto -q

# The suite once per kind of CPU, planned as on it (REDLINE_CPU; see the README): what CI machines
# differ in. Each run is a full suite, so this is for a change to the CPU facts, not for every commit.
FAKE_CPUS := avx2 avx512 amx arm
test-cpus: lint typecheck
	@failed=""; for cpu in $(FAKE_CPUS); do \
		echo "== REDLINE_CPU=$$cpu"; \
		REDLINE_CPU=$$cpu $(BIN)/python -m pytest -n auto -q || failed="$$failed $$cpu"; \
	done; \
	if [ -n "$$failed" ]; then echo "failed as:$$failed"; exit 1; fi

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
