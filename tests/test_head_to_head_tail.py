"""benchmarks/head_to_head_tail.py (issue 15): the fixed protocol is consistent, the maths of its report
is checked by hand on small cases, and ``--quick`` runs end to end (2 estimators x 1 seed x 2 steps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import artefact
from benchmarks import head_to_head_tail as tail
from estimators import GRPO, RLOO

REPO = Path(__file__).resolve().parents[1]


def test_protocol_matches_its_config_and_the_issue():
    proto = tail.PROTOCOL
    specs = tail.h2h.parse_estimators(proto["estimators"])
    assert specs[0].label == "GRPO"  # the reference of every paired difference
    assert {s.name for s in specs} == {"GRPO", "DrGRPO", "RLOO", "MaxRL", "SoftmaxGRPO"}
    assert sorted(s.init_args["temperature"] for s in specs if s.name == "SoftmaxGRPO") == [0.25, 0.5, 1.0, 2.0]
    config = yaml.safe_load((REPO / proto["config"]).read_text())["model"]
    assert config["group_size"] == proto["group_size"] == proto["val_samples"]  # pass@k up to G; K histogram
    levels = [str(lv) for lv in config["task"]["init_args"]["levels"]]
    assert proto["primary_levels"] == levels[-3:] and proto["steps"] % proto["val_every"] == 0


def test_report_maths_by_hand():
    # sample-std GRPO, G = 4: B1(K) = 2 sqrt(K (G-K) (G-1) / G) -> 3, 2 sqrt(3), 3 for K = 1, 2, 3
    b1 = [3.0, 2 * math.sqrt(3), 3.0]
    shares = tail.expected_shares(GRPO(), 4, torch.full((5,), 0.2))
    assert shares["hard"] == pytest.approx(b1[0] / sum(b1), rel=1e-5)
    assert shares["half"] == pytest.approx(b1[1] / sum(b1), rel=1e-5)
    assert shares["near_solved"] == pytest.approx(b1[2] / sum(b1), rel=1e-5)
    assert shares["unsolved"] == shares["solved"] == 0.0
    assert tail.binomial_law([0.5, 0.0], 2).tolist() == pytest.approx([0.625, 0.25, 0.125])
    # RLOO's c_G(p) = G for every p: the hard levels' share of the weight is their share of the levels
    assert tail.hard_weight_share(RLOO(), 8, {"3": 0.5, "8": 0.01, "9": 0.0}, ["8", "9"]) == pytest.approx(2 / 3)
    assert tail.trapezoid([{"a": 0.0}, {"a": 1.0}, {"a": 1.0}]) == {"a": 0.75}
    # t(0.975, 17) 0.02 / sqrt(18) = 0.00995 <= 0.01 < t(0.975, 16) 0.02 / sqrt(17) = 0.01028
    assert tail.seeds_needed(0.02, 0.01) == 18 and tail.seeds_needed(0.0, 0.01) == 2
    run = {"final": {"by_difficulty": {"3": 0.9, "8": 0.1, "9": 0.0}}}
    assert tail.primary(run, ["8", "9"]) == pytest.approx(0.05)


def test_holm_and_paired_p_by_hand():
    from benchmarks._h2h_stats import holm, paired_p

    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04): step-down, never below the previous
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    assert holm({"a": 0.5, "b": 0.9}) == {"a": 1.0, "b": 1.0}  # capped at 1
    adjusted = holm({"a": 0.02, "b": math.nan})  # a nan is not a comparison: m = 1
    assert adjusted["a"] == 0.02 and math.isnan(adjusted["b"])
    # d = 1, 2, 3: t = 2 sqrt(3) with 2 df, whose two-sided tail is 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14)
    assert paired_p([0.01, 0.02, 0.03]) == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert paired_p([0.01, 0.01]) == 0.0 and paired_p([0.0, 0.0]) == 1.0 and math.isnan(paired_p([0.1]))


def test_paired_stats_mark_holm_and_unadjusted_significance():
    spec = tail.h2h.parse_estimators(["estimators.GRPO", "estimators.RLOO", "estimators.DrGRPO"])

    def runs(values):
        return {s: {"final": {"by_difficulty": {"9": v}}} for s, v in enumerate(values)}

    results = {"GRPO": runs([0.1, 0.2, 0.3, 0.4]), "RLOO": runs([0.11, 0.21, 0.31, 0.41]),
               "DrGRPO": runs([0.12, 0.19, 0.33, 0.41])}  # fmt: skip
    stats = tail.paired_stats(results, spec, lambda r: r["final"]["by_difficulty"]["9"])
    assert stats["RLOO"]["mean"] == pytest.approx(0.01) and stats["RLOO"]["p"] == pytest.approx(0.0, abs=1e-9)
    assert stats["DrGRPO"]["holm_p"] == pytest.approx(max(stats["DrGRPO"]["p"], 2 * stats["RLOO"]["p"]))
    assert tail._verdict(stats["RLOO"]) == "yes (Holm)" and tail._verdict(stats["DrGRPO"]) == "no"
    assert tail._verdict({"mean": 0.02, "half": 0.01, "holm_p": 0.2}) == "yes (95 % only)"


@pytest.mark.slow
@pytest.mark.bench
def test_quick_runs_end_to_end(tmp_path, capsys):
    report = tail.main(["--quick", "--out", str(tmp_path)])
    text = report.read_text()
    for section in ("## Protocol", "## Primary: final accuracy on levels 7, 8, 9", "## pass@1 and pass@k by difficulty",
                    "## Gradient budget: theory against practice", "## Setup"):  # fmt: skip
        assert section in text
    assert "Quick mode" in text and "SoftmaxGRPO(temperature=0.5) | " in text
    history = json.loads((tmp_path / "GRPO" / "seed0" / "result.json").read_text())["history"]
    assert len(history) == 3 and all(len(v["success_counts"]) == 3 for v in history)  # 2 samples: c = 0, 1, 2
    assert all(sum(v["success_counts"]) == pytest.approx(1.0) for v in history)
    assert set(history[-1]["pass_at_k_by_difficulty"]) == {str(n) for n in range(3, 10)}
    assert list(history[-1]["pass_at_k_by_difficulty"]["9"]) == ["1", "2"]
    assert json.loads((tmp_path / "protocol.json").read_text())["steps"] == 2
    published = artefact.load("head_to_head_tail_quick")  # the test's folder (tests/conftest.py)
    assert published["command"] == ".venv/bin/python benchmarks/head_to_head_tail.py --quick"
    assert "Holm p" in (artefact.REPORTS / "head_to_head_tail_quick" / "report.md").read_text()
    assert published["result"]["primary"]["GRPO"]["vs_grpo"] is None
    assert published["result"]["run_time"]["runs"] == published["result"]["runs_finished"]  # the docs quote it
