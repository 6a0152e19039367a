"""The GPU smoke script's code path at toy size on CPU, so a GPU session finds it working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
def test_gpu_smoke_runs_at_tiny_size_on_cpu():
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_smoke.py", "--tiny", "--cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    decoders = next(line for line in lines if line.startswith("decoders:"))
    assert "greedy rows identical 100%" in decoders and "native Llama step on" in decoders
    graphs = next(line for line in lines if line.startswith("graphs:"))
    assert "greedy rows identical to lean 100%" in graphs
    summary = json.loads(next(line for line in lines if line.startswith("hf summary: ")).split(": ", 1)[1])
    assert summary["steps"] == 3 and summary["rollout_tok_s"] > 0 and summary["update_tok_s"] > 0
