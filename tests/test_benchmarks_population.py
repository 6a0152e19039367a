"""benchmarks/population.py reproduces reference tables of weights and budgets (docs/objective.md §4,
docs/gradient_budget.md §6, docs/reference_numbers.md §8.1).

The numbers below come from an independent numpy/scipy implementation of the formulas, printed to a
0.1 % unit; every one is compared with the script's computed table within 1e-3 absolute (shares as
fractions, so 1e-3 is that 0.1 % rounding unit; c_G values are
given to 4 decimals, c(0+)/c(1-), budgets and ratios to 3).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import population

TOL = 1e-3

# c_G(p) for G = 8 (docs/reference_numbers.md §8.1): p = 0.05, 0.25, 0.5, 0.75, 0.95, then c(0+), c(1-)
REFERENCE_C8 = {
    "GRPO (pop std)": [19.7845, 16.2089, 14.8452, 16.2089, 19.7845, 21.166, 21.166],
    "GRPO (sample std)": [18.5067, 15.1621, 13.8865, 15.1621, 18.5067, 19.799, 19.799],
    "Dr.GRPO": [7, 7, 7, 7, 7, 7, 7],
    "RLOO": [8, 8, 8, 8, 8, 8, 8],
    "MaxRL practical": [48.2660, 27.7285, 15.8750, 10.6660, 8.4211, 56, 8],
    "MaxRL cv_unbiased": [53.8527, 28.7964, 15.9375, 10.6665, 8.4211, 64, 8],
    "MaxRL nocv": [53.8527, 28.7964, 15.9375, 10.6665, 8.4211, 64, 8],
    "Softmax tau=0.25": [42.4402, 25.4014, 15.1144, 10.3535, 8.2346, 48.727, 7.833],
    "Softmax tau=0.5": [22.7013, 16.1979, 11.3507, 8.5348, 7.0785, 24.865, 6.786],
    "Softmax tau=1": [9.4693, 7.9953, 6.6067, 5.5795, 4.9433, 9.901, 4.804],
    "Softmax tau=2": [4.1139, 3.7946, 3.4484, 3.1520, 2.9449, 4.200, 2.897],
    "Softmax tau=4": [1.9011, 1.8283, 1.7435, 1.6651, 1.6065, 1.920, 1.592],
}

# large-G per-rollout weight w(p) = lim c_G/G (docs/objective.md §4) at p = 0.05, 0.25, 0.5, 0.75, 0.95
REFERENCE_LARGE_G = {
    "GRPO": [4.5883, 2.3094, 2.0000, 2.3094, 4.5883],
    "Dr.GRPO": [1, 1, 1, 1, 1],
    "RLOO": [1, 1, 1, 1, 1],
    "MaxRL": [20.000, 4.000, 2.000, 1.3333, 1.0526],
    "Softmax tau=0.25": [14.5651, 3.7222, 1.9281, 1.3010, 1.0324],
    "Softmax tau=0.5": [4.8422, 2.4599, 1.5232, 1.1031, 0.9037],
    "Softmax tau=1": [1.5823, 1.2020, 0.9242, 0.7508, 0.6528],
    "Softmax tau=2": [0.6283, 0.5582, 0.4898, 0.4364, 0.4014],
}

# budget shares under p ~ U(0, 1) in percent (docs/gradient_budget.md §6): hard, mid-hard, half, mid-easy,
# near-solved, then near/hard
REFERENCE_SHARES = {
    # "G = 8, L1 share" table
    (8, "l1"): {
        "GRPO": [25.5, 16.2, 16.7, 16.2, 25.5, 1.000],
        "Dr.GRPO": [22.6, 17.9, 19.0, 17.9, 22.6, 1.000],
        "RLOO": [22.6, 17.9, 19.0, 17.9, 22.6, 1.000],
        "MaxRL": [46.4, 17.9, 14.3, 10.7, 10.7, 0.231],
        "Softmax tau=0.25": [44.7, 18.2, 14.8, 11.1, 11.2, 0.251],
        "Softmax tau=0.5": [37.2, 19.3, 16.7, 13.1, 13.7, 0.368],
        "Softmax tau=1": [30.0, 19.3, 18.3, 15.3, 17.0, 0.568],
        "Softmax tau=2": [26.2, 18.8, 18.8, 16.6, 19.5, 0.746],
    },
    # "G = 8, L2 share" line (Dr.GRPO and RLOO "as in the L1 table")
    (8, "l2"): {
        "GRPO": [28.6, 14.3, 14.3, 14.3, 28.6, 1.0],
        "Dr.GRPO": [22.6, 17.9, 19.0, 17.9, 22.6, 1.000],
        "RLOO": [22.6, 17.9, 19.0, 17.9, 22.6, 1.000],
        "MaxRL": [72.8, 12.1, 7.3, 4.4, 3.5, 0.048],
        "Softmax tau=0.5": [54.2, 17.9, 12.5, 8.3, 7.1, 0.132],
        "Softmax tau=1": [38.3, 20.0, 16.7, 12.6, 12.3, 0.321],
        "Softmax tau=2": [30.0, 19.6, 18.4, 15.3, 16.7, 0.557],
    },
    # "G = 16, L1 share" table ("Dr.GRPO / RLOO" is one row)
    (16, "l1"): {
        "GRPO": [22.6, 23.4, 8.1, 23.4, 22.6, 1.000],
        "Dr.GRPO": [19.1, 26.2, 9.4, 26.2, 19.1, 1.000],
        "RLOO": [19.1, 26.2, 9.4, 26.2, 19.1, 1.000],
        "MaxRL": [45.0, 25.0, 6.7, 15.0, 8.3, 0.185],
        "Softmax tau=0.25": [42.4, 25.9, 7.0, 15.8, 8.9, 0.209],
        "Softmax tau=0.5": [33.4, 28.1, 8.1, 19.2, 11.2, 0.336],
        "Softmax tau=1": [26.0, 28.3, 9.0, 22.5, 14.2, 0.544],
        "Softmax tau=2": [22.4, 27.5, 9.3, 24.4, 16.4, 0.730],
    },
    # "G = 16, L2 share" line
    (16, "l2"): {
        "GRPO": [26.7, 20.0, 6.7, 20.0, 26.7, 1.0],
        "MaxRL": [77.0, 13.5, 2.6, 4.8, 2.0, 0.026],
        "Softmax tau=0.5": [51.2, 25.5, 5.9, 11.8, 5.5, 0.108],
        "Softmax tau=1": [34.1, 29.2, 8.2, 18.5, 10.0, 0.294],
        "Softmax tau=2": [26.0, 28.6, 9.1, 22.5, 13.8, 0.533],
    },
}

# per-K L1 budget for G = 8, K = 1..7 (docs/gradient_budget.md §6)
REFERENCE_PER_K_L1 = {
    "GRPO": [4.950, 6.481, 7.246, 7.483, 7.246, 6.481, 4.950],
    "Dr.GRPO": [1.75, 3, 3.75, 4, 3.75, 3, 1.75],
    "MaxRL": [14, 12, 10, 8, 6, 4, 2],
    "Softmax tau=1": [2.475, 3.606, 3.919, 3.697, 3.107, 2.252, 1.201],
}

# expected L1 budget for a prompt of true pass rate p, G = 8 (docs/gradient_budget.md §6):
# p = .05/.25/.5/.75/.95, ratio .95:.05
REFERENCE_EXPECTED_L1 = {
    "GRPO": [1.758, 5.686, 6.943, 5.686, 1.758, 1.00],
    "MaxRL": [4.585, 10.398, 7.938, 4.000, 0.800, 0.174],
    "Softmax tau=0.5": [2.157, 6.074, 5.675, 3.201, 0.673, 0.312],
    "Softmax tau=1": [0.900, 2.998, 3.303, 2.092, 0.470, 0.522],
}


@pytest.fixture(scope="module")
def computed():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    roster = population.roster()
    out = {
        "c8": population.weights(population.table_entries(), 8),
        "large_g": population.large_group_weights(roster),
        "per_k_l1": population.per_k_l1(roster, 8),
        "expected_l1": population.expected_l1(roster, 8),
    }
    for g in (8, 16):
        shares = population.share_rows(roster, g)
        for norm in ("l1", "l2"):
            out[(g, norm)] = shares[norm]
    torch.set_num_threads(threads)
    return out


def assert_table(name: str, computed: dict[str, list[float]], reference: dict[str, list[float]], scale=None) -> None:
    """Every reference cell within TOL; ``scale[j]`` divides reference column j first (percent -> fraction)."""
    worst = 0.0
    for label, row in reference.items():
        assert label in computed, f"{name}: no row {label!r} in the script's table ({sorted(computed)})"
        got = computed[label]
        assert len(got) == len(row), f"{name} / {label}: {len(got)} columns, the reference has {len(row)}"
        for j, value in enumerate(row):
            want = value / (scale[j] if scale else 1)
            diff = abs(got[j] - want)
            message = f"{name} / {label} column {j}: {got[j]:.6f} vs reference {want}"
            assert math.isfinite(got[j]) and diff <= TOL, message
            worst = max(worst, diff)
    print(f"{name}: {sum(map(len, reference.values()))} cells within {TOL:g} (max |diff| {worst:.2e})")


def test_section5_weights_g8(computed):
    assert_table("§5 c_G(p), G = 8", computed["c8"], REFERENCE_C8)


def test_section5_large_group_weights(computed):
    assert_table("§5 large-G weight", computed["large_g"], REFERENCE_LARGE_G)


@pytest.mark.parametrize("key", list(REFERENCE_SHARES), ids=lambda k: f"G{k[0]}-{k[1]}")
def test_section6_shares(computed, key):
    g, norm = key
    assert_table(f"§6 {norm.upper()} shares, G = {g}", computed[key], REFERENCE_SHARES[key], scale=[100] * 5 + [1])


def test_section6_per_k_l1_budgets(computed):
    assert_table("§6 per-K L1 budget, G = 8", computed["per_k_l1"], REFERENCE_PER_K_L1)


def test_section6_expected_l1_budget_by_pass_rate(computed):
    assert_table("§6 expected L1 budget, G = 8", computed["expected_l1"], REFERENCE_EXPECTED_L1)


def test_large_group_richardson_matches_softmax_closed_form():
    """The Richardson extrapolation used for estimators without a closed form agrees with
    SoftmaxGRPO.large_group_weight (the one closed form the library has) to 1e-4 relative."""
    p = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    for entry in population.roster()[4:]:
        extrapolated = population.richardson_limit(entry.estimator, p)
        torch.testing.assert_close(extrapolated, entry.estimator.large_group_weight(p), rtol=1e-4, atol=0)


def test_script_writes_tables(tmp_path, capsys):
    population.main(["--out", str(tmp_path), "--no-plots", "--threads", "1"])
    text = (tmp_path / "tables.md").read_text()
    assert "c_G(p) for G = 8" in text and "near/hard" in text
    assert "| Softmax tau=0.5 | 22.7013 | 16.1979 |" in capsys.readouterr().out
