# Two entry points for a fresh machine: `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast lint bench device-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Run again, `make train` starts afresh (--overwrite: it says so and deletes the earlier run's
# checkpoints); to continue that run instead: .venv/bin/paratrain train --out runs/default --resume
train: $(STAMP)
	$(BIN)/paratrain train --precision auto --out runs/default --overwrite

test: $(STAMP)
	$(BIN)/ruff check paratrain tests benchmarks examples
	$(BIN)/lint-imports --no-cache   # the layers of docs/architecture.md (.importlinter)
	$(BIN)/python -m pytest -q tests

# The edit loop's tier (docs/testing.md): lint, the import contracts, and the single- and
# two-process checks of every package, listed by node id in tests/fast.txt (chosen by their
# measured time; tests/test_fast_tier.py keeps every entry pointing at a real test). `make test`
# (CI, .ci/run) still runs everything.
test-fast: $(STAMP)
	$(BIN)/ruff check paratrain tests benchmarks examples
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q @tests/fast.txt

lint: $(STAMP)
	$(BIN)/ruff check paratrain tests benchmarks examples
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/paratrain bench single --json

# On a lent NVIDIA GPU (<= 8 min): the CUDA paths CPU tests cannot reach, one table; record it in
# docs/benchmarks.md ("Device check"). Without CUDA every row says SKIP.
device-check: $(STAMP)
	PYTHONPATH=. $(BIN)/python benchmarks/device_check.py

clean:
	rm -rf $(VENV) runs build *.egg-info
