"""benchmarks/packing.py end to end at its ``--quick`` size: every mode of every workload runs, the artefact is
published (into the test's temporary REPORTS, tests/conftest.py) and its docs block renders."""

from __future__ import annotations

import json

import pytest

from benchmarks import artefact
from benchmarks import packing as bench


@pytest.mark.bench
def test_quick_run_publishes_every_mode_and_its_render():
    folder = bench.main(["--quick"])
    assert folder == artefact.REPORTS / "packing"
    stamp = json.loads((folder / "result.json").read_text())
    assert stamp["command"] == ".venv/bin/python benchmarks/packing.py --quick"
    work = stamp["result"]["workloads"]
    assert [(w["budget"], w["skew"]) for w in work] == [(b, s) for b in bench.BUDGETS for s in bench.SKEWS]
    for w in work:
        modes = w["modes"]
        assert set(modes) == set(bench.MODES)
        assert len({m["real"] for m in modes.values()}) == 1  # every layout runs the same real tokens
        assert modes["packed"]["packed_speedup"] == 1.0 and modes["packed+shared"]["shared_speedup"] == 1.0
        for m in modes.values():
            assert len(m["times_s"]) == 1 and m["best_s"] > 0 and m["micro_batches"] >= 1
            assert m["padding_fraction"] < 1
        assert modes["padded+shared"]["padding_fraction"] > 0  # lengths vary: the padded layout computes padding
    figures = (folder / "figures.md").read_text()
    assert "`.venv/bin/python benchmarks/packing.py --quick`" in figures
    assert figures.count("\n| ") == 1 + len(work)  # the header, one row per workload
    assert "packed+shared speed-up over padded+shared" in figures


def test_workloads_follow_their_spec():
    """Prompt lengths are one per group and shared by its rows; completions lie in [4, cap] with the skew's shape."""
    for skew in bench.SKEWS:
        rollout = bench.workload({"skew": skew, "prompt": "long", "G": 16}, 256, 2048)
        prompts = rollout.attention_mask[:, : rollout.prompt_length].sum(-1)
        assert int(prompts.min()) >= 200 and int(prompts.max()) <= 400
        assert (prompts.view(2, 16) == prompts.view(2, 16)[:, :1]).all()
        ids = rollout.input_ids[:, : rollout.prompt_length].view(2, 16, -1)
        assert (ids == ids[:, :1]).all()  # one prompt per group
        lengths = rollout.completion_mask.sum(-1)
        assert int(lengths.min()) >= 4 and int(lengths.max()) <= 256
        median = float(lengths.float().median())
        assert median < 64 if skew == "log-uniform" else median > 64  # log-uniform: most completions short


def test_the_gpu_arithmetic_runs_on_a_cpu_and_a_missing_gpu_is_named():
    """``--device cuda``'s path without a GPU: a workload under bf16 autocast gives every mode the same real tokens,
    its first pass and no compile once warm; asking for a GPU where there is none says so, before any model."""
    import torch

    w = bench.measure_workload({"budget": "auto", "skew": "log-uniform", "prompt": "short", "G": 4}, quick=True,
                               threads=1, repeats=1, bf16=True)  # fmt: skip
    modes = w["modes"]
    assert len({m["real"] for m in modes.values()}) == 1 and w["graphs_compiled_measured"] == 0
    for m in modes.values():
        assert m["first_s"] > 0 and m["best_s"] > 0 and "flop_share" not in m  # no peak given: no share
    assert "attention" not in modes["padded+shared"] and modes["packed"]["attention"] == "sdpa"  # CPU: SDPA stays
    assert bench.sizes_of(False, "cuda")[0] is bench.GPU_MODEL and bench.sizes_of(True, "cuda")[0] is bench.QUICK_MODEL
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: torch sees no GPU here"):
            bench.main(["--device", "cuda", "--quick", "--no-publish"])
