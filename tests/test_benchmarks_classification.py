"""benchmarks/classification.py: the logit gradient by autograd, a seconds-long smoke run (--quick); and the
identity behind benchmarks/budget_norms.py on real rollouts (slow)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import classification


def test_logit_gradient_is_the_reinforce_sum():
    """sum_i A_i (onehot(y_i) - pi) equals autograd of sum_i A_i log softmax(z)[y_i], repeated labels included."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.tensor([[0, 0, 3, 6], [2, 2, 2, 2], [1, 5, 4, 0]])
    adv = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    (adv * torch.log_softmax(z, -1).gather(-1, labels)).sum().backward()
    got = classification.logit_gradient(torch.softmax(z.detach(), -1), labels, adv)
    torch.testing.assert_close(got, z.grad, rtol=0, atol=1e-12)


def test_quick_run_learns_and_reports(tmp_path):
    """--quick: 5 estimators x 2 seeds on 40 classes; every estimator beats the uniform policy, pass@k >= pass@1,
    metrics are fractions, RLOO and Dr.GRPO take the same steps (objective-normalised learning rates), and
    the report is written."""
    out = classification.main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    run, summary = out["run"], out["summary"]
    curve = run["curve"]  # [evals, E, S, metrics]: top-1, pass@1, pass@5, pass@32
    assert ((curve >= 0) & (curve <= 1)).all()
    assert (curve[..., 2] >= curve[..., 1]).all() and (curve[..., 3] >= curve[..., 2]).all()
    torch.testing.assert_close(curve[0, :, :, 1], torch.full_like(curve[0, :, :, 1], 1 / 40))  # uniform start
    labels = list(summary["estimators"])
    assert labels[0] == "GRPO" and summary["estimators"]["GRPO"]["top-1"]["diff"] == 0
    for label, row in summary["estimators"].items():
        assert row["pass@1"]["mean"] > 100 / 40 + 2, label  # learned from rewards alone
    dr, rloo = labels.index("Dr.GRPO"), labels.index("RLOO")
    torch.testing.assert_close(curve[:, dr], curve[:, rloo], rtol=0, atol=1e-3)
    assert "Δ top-1 vs GRPO" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.bench
def test_budget_norms_identity_on_real_rollouts():
    """benchmarks/budget_norms.py (one small batch of the quickstart model): ||U|| = (B1/2) D holds to float32
    rounding for every estimator, and the near/hard ratios of L1 mass and update norms are reported."""
    from benchmarks import budget_norms

    result = budget_norms.main(["--seeds", "1", "--prompts", "6"])
    assert result["identity_max_rel_gap"] < 1e-4
    assert set(result["ratios"]) >= {"GRPO", "MaxRL", "Softmax tau=0.5"}


def test_learning_rate_sweep_reports_each_estimator_at_its_best_rate():
    """benchmarks/classification_lr.py --quick at two rates: a best rate per estimator, chosen by top-1 among
    the rates run, and the seed-paired difference to GRPO at its own best rate (0 for GRPO itself). With two
    rates every best rate is at an edge of the grid, and the result says which."""
    from benchmarks import classification_lr

    result = classification_lr.main(["--quick", "--threads", "1", "--lrs", "4", "16"])
    assert result["lrs"] == [4.0, 16.0] and set(result["by_lr"]) == {"4.0", "16.0"}
    for label, best in result["best"].items():
        tops = [result["by_lr"][str(lr)]["estimators"][label]["top-1"]["mean"] for lr in result["lrs"]]
        assert best["lr"] in result["lrs"] and best["top-1"] == max(tops), label
        assert best["edge"] == ("lowest" if best["lr"] == 4.0 else "highest"), label
    assert result["best"]["GRPO"]["diff"] == 0
    assert result["at_edge"] == list(result["best"])


def test_learning_rate_sweep_grid_edges():
    """grid_edge flags a best rate at the smallest or largest rate of the grid (its optimum may lie beyond)."""
    from benchmarks.classification_lr import grid_edge

    grid = [1.0, 4.0, 16.0, 64.0]
    assert [grid_edge(lr, grid) for lr in grid] == ["lowest", None, None, "highest"]
    assert grid_edge(8.0, [8.0]) == "only"
