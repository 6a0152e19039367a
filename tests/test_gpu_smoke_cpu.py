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


def test_the_head_benchmark_runs_at_tiny_size_on_cpu(capsys):
    """benchmarks/head_dtype.py (part of benchmarks/gpu_session.sh) at toy size on CPU: every path reported, the
    bf16 head within bf16's rounding of float32, and the sampler's head equal to the loss's."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.head_dtype import main

    assert main(["--device", "cpu", "--tiny", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines if line.split()[0] in ("fp32", "bf16", "bf16_one_part")}
    assert len(rows) == 3 and "absent: float32 emulation" in lines[0]  # CPU: no out_dtype matmul
    bf16_max = float(rows["bf16"].split("max ")[1].split()[0])
    assert 0 < bf16_max < 1e-2
    gap = float(next(line for line in lines if line.startswith("on-policy gap")).rsplit("max ", 1)[1])
    assert gap < 1e-5
