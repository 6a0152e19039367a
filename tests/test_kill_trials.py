"""benchmarks/kill_trials.py at test size: a fit of configs/tiny.yaml killed with SIGKILL inside the end-of-fit export
and inside a checkpoint write resumes (``--ckpt_path last``) to the uninterrupted run's metrics and weights, bit for
bit. The script runs 20 such trials (docs/runs.md gives the figures)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kill_trials import differences, outcome, summary, trials


@pytest.mark.bench  # an end-to-end run of benchmarks/kill_trials.py (make test-bench, which CI runs)
def test_kills_inside_the_export_and_a_checkpoint_write_resume_exactly(tmp_path):
    results = trials(2, seed=0, workdir=tmp_path, every_place=True)
    assert [r["where"] for r in results] == ["export", "checkpoint"] and all(r["killed"] for r in results), results
    assert all(r["exact"] for r in results), summary(results)
    # the comparison finds a change: one weight, one step's metric
    want = outcome(tmp_path / "reference")
    metrics, weights = outcome(tmp_path / "trial0")
    name = next(k for k in weights if k.startswith("hf_model/"))
    changed = {**weights, name: weights[name] + torch.finfo(weights[name].dtype).eps * weights[name].abs().max()}
    assert differences((metrics, changed), want) == [f"tensor {name} differs"]
    fewer = {**metrics, "train/reward": {s: v for s, v in metrics["train/reward"].items() if s != 2}}
    assert differences((fewer, weights), want) == ["metric train/reward differs (steps [2] missing)"]
