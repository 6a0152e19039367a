"""benchmarks/head_to_head.py end to end on a tiny budget: 2 estimators x 1 seed x 2 steps, validated on
12 prompts x 2 samples before training and after every step; then a re-run that skips both finished runs,
and one with other settings that refuses to reuse them. Estimator specs and the paired statistics are
checked by hand on small numbers."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import artefact
from benchmarks import head_to_head as h2h

ESTIMATORS = ["estimators.GRPO", 'estimators.SoftmaxGRPO:{"temperature": 0.5}']


def test_estimator_specs_parse_check_and_name_folders(tmp_path):
    grpo, soft = h2h.parse_estimators(ESTIMATORS)
    assert (grpo.class_path, grpo.init_args, grpo.label) == ("estimators.GRPO", {}, "GRPO")
    assert soft.label == "SoftmaxGRPO(temperature=0.5)" and soft.slug == "SoftmaxGRPO_temperature-0.5"
    assert json.loads(soft.cli_value()) == {"class_path": "estimators.SoftmaxGRPO", "init_args": {"temperature": 0.5}}
    roster = tmp_path / "roster.yaml"
    roster.write_text("- class_path: estimators.MaxRL\n  init_args: {variant: practical}\n")
    (maxrl,) = h2h.parse_estimators([str(roster)])
    assert maxrl.label == "MaxRL(variant=practical)"
    with pytest.raises(SystemExit, match="not JSON"):
        h2h.parse_estimators(["estimators.SoftmaxGRPO:{temperature: 0.5}"])
    with pytest.raises(ValueError, match="tau must be > 0|temperature"):
        h2h.EstimatorSpec("estimators.SoftmaxGRPO", {"temperature": -1.0}).check()
    with pytest.raises(SystemExit, match="not an AdvantageEstimator"):
        h2h.EstimatorSpec("sgrpo.fit.SgrpoCLI").check()


def _run(seed: int, final: float) -> dict:
    entry = {"mean_over_levels": final}
    return {"seed": seed, "initial": entry, "final": entry}


def test_paired_difference_uses_seed_pairs():
    # a - b per seed: 0.10, 0.20, 0.30 -> mean 0.20, sd 0.10, t(0.975, 2) = 4.3027 -> half = 4.3027 * 0.1 / sqrt(3)
    a = {s: _run(s, v) for s, v in enumerate([0.5, 0.6, 0.7])}
    b = {s: _run(s, v) for s, v in enumerate([0.4, 0.4, 0.4])}
    mean, half, n = h2h.paired(a, b)
    assert n == 3 and mean == pytest.approx(0.2) and half == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    text = h2h.conclusion({"A": a, "B": b}, h2h.parse_estimators(["estimators.DrGRPO"]))
    assert "**Best: A**" in text and "+20.0 pts" in text and "significant difference" in text


@pytest.mark.slow
@pytest.mark.bench
def test_tiny_benchmark_reports_and_skips_finished_runs(tmp_path, capsys):
    args = [
        *("--estimators", *ESTIMATORS),
        *("--seeds", "0", "--steps", "2", "--val-every", "1", "--val-samples", "2", "--jobs", "2"),
        "--extra=--model.task.init_args.num_validation=12 --model.val_prompts_per_batch=12",
        *("--out", str(tmp_path)),
    ]
    report = h2h.main(args)
    text = report.read_text()
    assert "Runs finished: 2 of 2" in text
    assert "**Best: GRPO**" in text or "**Best: SoftmaxGRPO(temperature=0.5)**" in text
    for png in ("accuracy_by_difficulty", "accuracy_curves", "pass_at_k", "budget_shares"):
        assert (tmp_path / f"{png}.png").stat().st_size > 0 and f"({png}.png)" in text
    result_path = tmp_path / "GRPO" / "seed0" / "result.json"
    result = json.loads(result_path.read_text())
    assert [e["step"] for e in result["history"]] == [0, 1, 2]  # CSV steps 0, 0, 1: two rows share step 0
    assert set(result["final"]["by_difficulty"]) == {"3", "5", "7"} and set(result["final"]["pass_at_k"]) == {"1", "2"}
    stamp = result_path.stat().st_mtime_ns
    capsys.readouterr()
    h2h.main(args)
    out = capsys.readouterr().out
    assert out.count("[skip]") == 2 and "[run]" not in out
    assert result_path.stat().st_mtime_ns == stamp
    h2h.main([*args, "--report-only"])  # publishes the runs' figures under the command that makes them
    published = artefact.load("head_to_head")  # in the test's folder (tests/conftest.py), not benchmarks/reports
    assert "--report-only" not in published["command"] and published["command"].endswith(str(tmp_path))
    grpo = published["result"]["estimators"]["GRPO"]
    assert grpo["mean_over_levels"][0] == pytest.approx(result["final"]["mean_over_levels"]) and grpo["seeds"] == [0]
    assert published["result"]["estimators"]["SoftmaxGRPO(temperature=0.5)"]["vs_grpo"][2] == 1  # one paired seed
    # what the docs' rendered block reads (benchmarks/figures/h2h.py), written by the benchmark itself
    figures = published["result"]
    assert figures["run_time"]["runs"] == 2 and "wall_minutes" not in figures["run_time"]  # --report-only: no wall
    low, high = figures["base"]["mean_over_levels_range"]
    assert low == high == pytest.approx(figures["base"]["mean_over_levels"][0])  # one seed
    assert set(figures["estimators"]["SoftmaxGRPO(temperature=0.5)"]["pass_at_k_vs_grpo"]) == {"1", "2"}
    with pytest.raises(SystemExit, match="other settings"):
        h2h.main([*args, "--val-samples", "3"])
