# The README's two commands: `make quickstart` and `make test`. Both set up .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# On the project's CPU machines this takes the CPU wheel that lies on disk; GPU users can override,
# e.g. `make TORCH_SPEC='torch==2.13.0' install` on a CUDA machine gets the CUDA build from PyPI.
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 2

.PHONY: install test lint quickstart bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Tests run on TEST_WORKERS processes (pytest-xdist), one thread each: many tests wait on subprocesses
# or start 2-process runs, so two workers keep a 2-core machine busy (8.5 -> 6.5 minutes measured).
TEST_WORKERS ?= 2
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

quickstart: $(STAMP)
	$(PY) -m sgrpo.fit --config configs/quickstart.yaml --overwrite true

bench: $(STAMP)
	$(PY) benchmarks/estimators.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
