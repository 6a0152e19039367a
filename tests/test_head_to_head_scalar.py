"""benchmarks/head_to_head_scalar.py (issue 26): the pre-registered protocol is consistent with its pilot and
config, its statistics are checked by hand, and ``--quick`` runs and publishes end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import head_to_head_scalar as scalar

REPO = Path(__file__).resolve().parents[1]


def test_protocol_matches_its_pilot_config_and_the_issue():
    proto = scalar.PROTOCOL
    specs = scalar.tail.h2h.parse_estimators(proto["estimators"])
    assert [s.name for s in specs] == ["GRPO", "DrGRPO", "SoftmaxGRPO", "SoftmaxGRPO"]  # GRPO: the reference
    fixed, per_group = specs[2].init_args, specs[3].init_args
    assert fixed == {"temperature": proto["pilot"]["tau"]} and per_group["temperature_rule"] == "ess"
    # the rule: the pilot's mean within-group std to two significant digits; every run logs log_mgf at it
    assert float(f"{proto['pilot']['std_mean']:.2g}") == proto["pilot"]["tau"] == scalar.TAU
    assert f"--model.log_mgf_temperature={scalar.TAU}" in proto["extra"]
    config = yaml.safe_load((REPO / proto["config"]).read_text())["model"]
    assert config["task"]["init_args"]["reward"]["class_path"] == "tasks.similarity.EditSimilarity"
    assert config["group_size"] == proto["group_size"] == proto["val_samples"]
    assert len(proto["seeds"]) == 12 and proto["steps"] == 200 and proto["primary_levels"] == ["7", "8", "9"]


def test_every_roster_entry_builds_its_own_estimator_over_the_config(tmp_path, monkeypatch):
    """An override of the config's estimator class merges init args (jsonargparse): each run must get exactly
    the estimator its spec names (the first full start built SoftmaxGRPO(0.16) with the config's ESS rule)."""
    from sgrpo.fit import parse

    monkeypatch.chdir(REPO)
    for spec in scalar.tail.h2h.parse_estimators(scalar.PROTOCOL["estimators"]):
        cli = parse(["--config", scalar.PROTOCOL["config"], f"--model.estimator={spec.cli_value()}",
                     f"--trainer.default_root_dir={tmp_path}", *scalar.PROTOCOL["extra"].split()])  # fmt: skip
        expected = scalar.tail.h2h_estimator(spec)
        assert repr(cli.model.estimator) == repr(expected) and cli.model.log_mgf_temperature == scalar.TAU


def test_statistics_by_hand():
    # Holm, m = 3: 0.01 -> 0.03, 0.03 -> max(0.03, 2 x 0.03) = 0.06, 0.04 -> max(0.06, 0.04) = 0.06
    assert scalar.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert scalar.holm([0.5, math.nan, 0.6]) == [pytest.approx(1.0), pytest.approx(math.nan, nan_ok=True), 1.0]
    # d = (1, 2, 3): mean 2, sd 1, t = 2 sqrt 3 = 3.4641 on 2 df, two-sided p = 0.07418; h = 4.3027 / sqrt 3
    mean, half, p = scalar.paired_test([1.0, 2.0, 3.0])
    assert (mean, half, p) == pytest.approx((2.0, 4.302653 / math.sqrt(3), 0.074180), rel=1e-5)
    assert scalar.paired_test([0.5, 0.5])[2] == 0.0 and scalar.paired_test([0.0, 0.0])[2] == 1.0
    assert math.isnan(scalar.paired_test([0.5])[2])


def test_pilot_statistics_by_hand():
    # group 1: std of (0, 0.5, 1, 0.5) = sqrt(1/6) = 0.40825; group 2: (0.2, 0.2, 0.4, 0.4) std 0.11547;
    # group 3 is constant: left out. tau = mean 0.26186 -> 0.26
    r = torch.tensor([[0.0, 0.5, 1.0, 0.5], [0.2, 0.2, 0.4, 0.4], [0.7, 0.7, 0.7, 0.7]])
    stats = scalar.pilot_stats(r)
    assert stats["constant_groups"] == 1 and stats["groups"] == 3
    assert stats["std_mean"] == pytest.approx((math.sqrt(1 / 6) + math.sqrt(0.04 / 3)) / 2, rel=1e-6)
    assert stats["tau"] == 0.26 and stats["range_mean"] == pytest.approx(0.6, rel=1e-6)


def test_tail_mean_reads_the_last_steps(tmp_path):
    csv = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("epoch,step,train/log_mgf,val/accuracy\n" + "".join(f"0,{s},{s / 10},\n" for s in range(5))
                   + "0,4,,0.5\n")  # fmt: skip
    assert scalar.tail_mean(tmp_path, "train/log_mgf", 2) == pytest.approx(0.35)
    assert math.isnan(scalar.tail_mean(tmp_path, "train/nothing", 2))


@pytest.mark.slow
@pytest.mark.bench
def test_quick_runs_and_publishes_end_to_end(tmp_path):
    report = scalar.main(["--quick", "--out", str(tmp_path / "runs"), "--reports", str(tmp_path / "reports")])
    text = report.read_text()
    for section in ("## Protocol", "## Primary: final exact-match accuracy on levels 7, 8, 9",
                    "## Secondary: log-MGF objective", "## Secondary: mean edit similarity", "## Setup"):  # fmt: skip
        assert section in text
    artefact = tmp_path / "reports" / "scalar_head_to_head_quick"
    stamp = json.loads((artefact / "result.json").read_text())
    assert stamp["command"] in (artefact / "report.md").read_text()
    (row,) = stamp["result"]["secondary"]["train/log_mgf"]["rows"]  # one comparison: the ESS rule vs GRPO
    assert row["n"] == 1 and "temperature_rule=ess" in row["estimator"]
    run = tmp_path / "runs" / scalar.tail.h2h.parse_estimators([scalar.ESS_SPEC])[0].slug / "seed0"
    logged = scalar.tail_mean(run, "train/log_mgf", 2)
    assert math.isfinite(logged) and 0.0 <= logged <= 1.0  # a soft maximum of rewards in [0, 1]
    assert stamp["result"]["runs_finished"] == 2
    # what the docs' rendered block reads (benchmarks/figures/h2h.py), written by the benchmark itself
    assert stamp["result"]["run_time"]["runs"] == 2
    assert set(stamp["result"]["budget_l1"]) == {"GRPO", row["estimator"]}
    shares = stamp["result"]["budget_l1"]["GRPO"]
    assert {"unsolved", "near_solved"} <= set(shares) and sum(v[0] for v in shares.values()) <= 1 + 1e-9
    assert set(stamp["result"]["pass_primary_vs_grpo"]) <= {row["estimator"]}  # one seed: no interval, maybe none
