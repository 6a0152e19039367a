"""Gradient budget by prompt difficulty (docs/gradient_budget.md §6); reference numbers from an independent numpy/scipy
implementation of its formulas.

Under the prior p ~ U(0, 1) every K = 0..G has probability 1/(G+1), so the expected share of a
bucket is the budget of the G+1 binary groups (one per K), bucketed by K/G: exactly what
``gradient_budget(est.binary_group_advantages(G), K/G)`` computes.
"""

from __future__ import annotations

import math

import pytest
import torch

from estimators import (
    BUCKETS,
    GRPO,
    RLOO,
    DrGRPO,
    MaxRL,
    SoftmaxGRPO,
    budget_mass,
    budget_shares,
    difficulty_bucket,
    gradient_budget,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


F64 = torch.float64
REPORTED = ("hard", "mid_hard", "half", "mid_easy", "near_solved")


def uniform_prior_shares(est, g: int) -> dict[str, float]:
    table = est.binary_group_advantages(g)  # row K: K successes
    rate = torch.arange(g + 1, dtype=F64) / g
    return {key: value.item() for key, value in gradient_budget(table, rate).items()}


# ---------------------------------------------------------------------------------------------
# buckets
# ---------------------------------------------------------------------------------------------


def test_bucket_names():
    assert BUCKETS == ("unsolved", "hard", "mid_hard", "half", "mid_easy", "near_solved", "solved")


def test_bucket_boundaries():
    """unsolved {0}, hard (0, 1/4], mid-hard (1/4, 1/2), half {1/2}, mid-easy (1/2, 3/4),
    near-solved [3/4, 1), solved {1}; boundaries tolerate float noise of 1e-12."""
    cases = {
        0.0: "unsolved",
        1e-6: "hard",
        1 / 16: "hard",
        0.25: "hard",
        0.25 + 1e-12: "hard",  # noise on the boundary stays on its side
        0.25 + 1e-6: "mid_hard",
        0.3: "mid_hard",
        0.5 - 1e-6: "mid_hard",
        0.5 - 1e-12: "half",
        0.5: "half",
        0.5 + 1e-12: "half",
        0.5 + 1e-6: "mid_easy",
        0.7: "mid_easy",
        0.75 - 1e-6: "mid_easy",
        0.75 - 1e-12: "near_solved",
        0.75: "near_solved",
        0.9: "near_solved",
        1 - 1e-6: "near_solved",
        1 - 1e-12: "solved",
        1.0: "solved",
    }
    idx = difficulty_bucket(torch.tensor(list(cases), dtype=F64))
    assert [BUCKETS[i] for i in idx.tolist()] == list(cases.values())


@pytest.mark.parametrize(
    ("g", "expected"),
    [
        # K = 0..8: 0 | 1/8 2/8 | 3/8 | 4/8 | 5/8 | 6/8 7/8 | 1
        (8, ["unsolved"] + ["hard"] * 2 + ["mid_hard", "half", "mid_easy"] + ["near_solved"] * 2 + ["solved"]),
        # K = 0..16: 0 | 1..4 | 5..7 | 8 | 9..11 | 12..15 | 16
        (
            16,
            ["unsolved"]
            + ["hard"] * 4
            + ["mid_hard"] * 3
            + ["half"]
            + ["mid_easy"] * 3
            + ["near_solved"] * 4
            + ["solved"],
        ),
    ],
)
def test_buckets_of_group_success_rates(g, expected):
    # rates as a trainer computes them, the mean of the group's binary rewards
    rewards = (torch.arange(g).unsqueeze(0) < torch.arange(g + 1).unsqueeze(1)).to(torch.float32)
    assert [BUCKETS[i] for i in difficulty_bucket(rewards.mean(-1)).tolist()] == expected


# ---------------------------------------------------------------------------------------------
# the metric's mechanics
# ---------------------------------------------------------------------------------------------


def test_shares_sum_to_one_and_masses_add():
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(300, 8, generator=gen) < torch.rand(300, 1, generator=gen)).to(F64)
    rate = rewards.mean(-1)
    for est in (GRPO(), DrGRPO(), MaxRL(), SoftmaxGRPO(0.5), MaxRL("cv_unbiased")):
        adv = est(rewards)
        shares = gradient_budget(adv, rate)
        assert set(shares) == {f"{n}/{b}" for n in ("l1", "l2") for b in BUCKETS}
        for norm in ("l1", "l2"):
            total = sum(shares[f"{norm}/{b}"].item() for b in BUCKETS)
            assert total == pytest.approx(1.0, abs=1e-12)
            assert all(shares[f"{norm}/{b}"].item() >= 0 for b in BUCKETS)
        # masses add across batches (so they can be all-reduced before normalising)
        whole = budget_mass(adv, rate)
        parts = budget_mass(adv[:100], rate[:100]) + budget_mass(adv[100:], rate[100:])
        torch.testing.assert_close(whole, parts, rtol=1e-12, atol=0)
        # hand check of the masses: row 0 is sum |A|, row 1 sum A^2
        assert whole[0].sum().item() == pytest.approx(adv.abs().sum().item(), rel=1e-12)
        assert whole[1].sum().item() == pytest.approx(adv.square().sum().item(), rel=1e-12)


def test_constant_groups_carry_no_budget_except_cv_unbiased():
    """K = 0 and K = G carry zero for every estimator except MaxRL cv_unbiased, whose -1 per member
    in unsolved groups shows up in the 'unsolved' bucket instead of being dropped."""
    for est in (GRPO(), DrGRPO(), RLOO(), MaxRL(), SoftmaxGRPO(0.25)):
        shares = uniform_prior_shares(est, 8)
        assert shares["l1/unsolved"] == 0 and shares["l1/solved"] == 0
    cv = uniform_prior_shares(MaxRL("cv_unbiased"), 8)
    # K = 0 group: sum |A| = 8; the others 2(G-K) = 14, 12, ..., 2 (sum 56): share 8 / 64
    assert cv["l1/unsolved"] == pytest.approx(8 / 64, abs=1e-12)
    assert cv["l1/solved"] == 0


def test_no_mass_gives_zero_shares_and_bad_shapes_raise():
    shares = budget_shares(torch.zeros(2, len(BUCKETS), dtype=F64))
    assert all(v.item() == 0 for v in shares.values())
    with pytest.raises(ValueError, match="group_success_rate"):
        budget_mass(torch.zeros(4, 8), torch.zeros(3))
    with pytest.raises(ValueError, match="group_success_rate"):
        budget_mass(torch.zeros(8), torch.zeros(8))


# ---------------------------------------------------------------------------------------------
# per-K L1 budgets (raw L1 budget per group)
# ---------------------------------------------------------------------------------------------

PER_K_L1 = {
    8: [
        (GRPO(), [4.950, 6.481, 7.246, 7.483, 7.246, 6.481, 4.950]),
        (DrGRPO(), [1.750, 3.000, 3.750, 4.000, 3.750, 3.000, 1.750]),
        (RLOO(), [2.000, 3.429, 4.286, 4.571, 4.286, 3.429, 2.000]),
        (MaxRL(), [14, 12, 10, 8, 6, 4, 2]),
        (SoftmaxGRPO(0.25), [12.182, 11.167, 9.526, 7.712, 5.826, 3.903, 1.958]),
        (SoftmaxGRPO(0.5), [6.216, 7.380, 7.055, 6.093, 4.798, 3.309, 1.697]),
        (SoftmaxGRPO(1.0), [2.475, 3.606, 3.919, 3.697, 3.107, 2.252, 1.201]),
        (SoftmaxGRPO(2.0), [1.050, 1.675, 1.957, 1.959, 1.731, 1.309, 0.724]),
    ],
    16: [
        (
            GRPO(),
            [
                7.500,
                10.247,
                12.093,
                13.416,
                14.361,
                15.000,
                15.370,
                15.492,
                15.370,
                15.000,
                14.361,
                13.416,
                12.093,
                10.247,
                7.500,
            ],
        ),
        (
            DrGRPO(),
            [1.875, 3.500, 4.875, 6.000, 6.875, 7.500, 7.875, 8.000, 7.875, 7.500, 6.875, 6.000, 4.875, 3.500, 1.875],
        ),
        (MaxRL(), [30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2]),
        (
            SoftmaxGRPO(0.5),
            [
                8.561,
                12.433,
                14.171,
                14.760,
                14.658,
                14.111,
                13.257,
                12.186,
                10.952,
                9.597,
                8.146,
                6.619,
                5.031,
                3.393,
                1.714,
            ],
        ),
        (
            SoftmaxGRPO(1.0),
            [2.909, 4.951, 6.335, 7.212, 7.686, 7.837, 7.725, 7.394, 6.881, 6.214, 5.416, 4.505, 3.496, 2.402, 1.234],
        ),
    ],
}


@pytest.mark.parametrize("g", sorted(PER_K_L1))
def test_t16_per_k_l1_budget(g):
    """sum_i |A_i| of the binary group with K successes, K = 1..G-1 (1e-3)."""
    for est, row in PER_K_L1[g]:
        budget = est.binary_group_advantages(g)[1:-1].abs().sum(-1)
        torch.testing.assert_close(budget, torch.tensor(row, dtype=F64), rtol=0, atol=1e-3, msg=repr(est))


@pytest.mark.parametrize("g", [2, 5, 8, 16])
def test_per_k_l1_budget_closed_forms(g):
    """§6 closed forms (1e-12): GRPO-pop 2 sqrt(K(G-K)); Dr.GRPO 2K(G-K)/G; MaxRL 2(G-K);
    Softmax 2K(G-K) lam/(1 + K lam); and GRPO sample's L2 budget is G-1 for every mixed group."""
    k = torch.arange(1, g, dtype=F64)

    def l1(est):
        return est.binary_group_advantages(g)[1:-1].abs().sum(-1)

    torch.testing.assert_close(l1(GRPO("population", eps=0.0)), 2 * (k * (g - k)).sqrt(), rtol=1e-12, atol=0)
    torch.testing.assert_close(l1(DrGRPO()), 2 * k * (g - k) / g, rtol=1e-12, atol=0)
    torch.testing.assert_close(l1(MaxRL()), 2 * (g - k), rtol=1e-12, atol=0)
    for tau in (0.25, 1.0):
        lam = math.expm1(1 / tau) / g
        torch.testing.assert_close(l1(SoftmaxGRPO(tau)), 2 * k * (g - k) * lam / (1 + k * lam), rtol=1e-12, atol=0)
    l2 = GRPO("sample", eps=0.0).binary_group_advantages(g)[1:-1].square().sum(-1)
    torch.testing.assert_close(l2, torch.full_like(l2, g - 1.0), rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# §6 expected shares under p ~ U(0, 1), G = 8 and 16 (percent; hard, mid-hard, half, mid-easy,
# near-solved), and the near/hard ratio
# ---------------------------------------------------------------------------------------------

SHARE_TABLES = {
    (8, "l1"): [
        (GRPO(), [25.5, 16.2, 16.7, 16.2, 25.5], 1.000),
        (DrGRPO(), [22.6, 17.9, 19.0, 17.9, 22.6], 1.000),
        (RLOO(), [22.6, 17.9, 19.0, 17.9, 22.6], 1.000),
        (MaxRL(), [46.4, 17.9, 14.3, 10.7, 10.7], 0.231),
        (SoftmaxGRPO(0.25), [44.7, 18.2, 14.8, 11.1, 11.2], 0.251),
        (SoftmaxGRPO(0.5), [37.2, 19.3, 16.7, 13.1, 13.7], 0.368),
        (SoftmaxGRPO(1.0), [30.0, 19.3, 18.3, 15.3, 17.0], 0.568),
        (SoftmaxGRPO(2.0), [26.2, 18.8, 18.8, 16.6, 19.5], 0.746),
    ],
    (8, "l2"): [
        (GRPO(), [28.6, 14.3, 14.3, 14.3, 28.6], 1.000),
        (DrGRPO(), [22.6, 17.9, 19.0, 17.9, 22.6], 1.000),
        (RLOO(), [22.6, 17.9, 19.0, 17.9, 22.6], 1.000),
        (MaxRL(), [72.8, 12.1, 7.3, 4.4, 3.5], 0.048),
        (SoftmaxGRPO(0.25), [69.5, 13.3, 8.2, 5.0, 4.0], 0.058),
        (SoftmaxGRPO(0.5), [54.2, 17.9, 12.5, 8.3, 7.1], 0.132),
        (SoftmaxGRPO(1.0), [38.3, 20.0, 16.7, 12.6, 12.3], 0.321),
        (SoftmaxGRPO(2.0), [30.0, 19.6, 18.4, 15.3, 16.7], 0.557),
    ],
    (16, "l1"): [
        (GRPO(), [22.6, 23.4, 8.1, 23.4, 22.6], 1.000),
        (DrGRPO(), [19.1, 26.2, 9.4, 26.2, 19.1], 1.000),
        (RLOO(), [19.1, 26.2, 9.4, 26.2, 19.1], 1.000),
        (MaxRL(), [45.0, 25.0, 6.7, 15.0, 8.3], 0.185),
        (SoftmaxGRPO(0.25), [42.4, 25.9, 7.0, 15.8, 8.9], 0.209),
        (SoftmaxGRPO(0.5), [33.4, 28.1, 8.1, 19.2, 11.2], 0.336),
        (SoftmaxGRPO(1.0), [26.0, 28.3, 9.0, 22.5, 14.2], 0.544),
        (SoftmaxGRPO(2.0), [22.4, 27.5, 9.3, 24.4, 16.4], 0.730),
    ],
    (16, "l2"): [
        (GRPO(), [26.7, 20.0, 6.7, 20.0, 26.7], 1.000),
        (DrGRPO(), [19.1, 26.2, 9.4, 26.2, 19.1], 1.000),
        (RLOO(), [19.1, 26.2, 9.4, 26.2, 19.1], 1.000),
        (MaxRL(), [77.0, 13.5, 2.6, 4.8, 2.0], 0.026),
        (SoftmaxGRPO(0.25), [71.7, 16.4, 3.3, 6.1, 2.6], 0.036),
        (SoftmaxGRPO(0.5), [51.2, 25.5, 5.9, 11.8, 5.5], 0.108),
        (SoftmaxGRPO(1.0), [34.1, 29.2, 8.2, 18.5, 10.0], 0.294),
        (SoftmaxGRPO(2.0), [26.0, 28.6, 9.1, 22.5, 13.8], 0.533),
    ],
}


@pytest.mark.parametrize(("g", "norm"), sorted(SHARE_TABLES), ids=lambda v: str(v))
def test_expected_shares_under_uniform_prior(g, norm):
    """§6 tables (printed to 0.1%, compared at 1e-3 on the share) and near/hard (1e-3).

    By hand, MaxRL G = 8 L1: per-K budgets 2(8-K) = 14..2 sum to 56; hard = (14+12)/56 = 46.4%,
    near-solved = (4+2)/56 = 10.7%, near/hard = 6/26 = 0.231.
    """
    for est, row, ratio in SHARE_TABLES[(g, norm)]:
        shares = uniform_prior_shares(est, g)
        got = torch.tensor([shares[f"{norm}/{b}"] for b in REPORTED], dtype=F64)
        torch.testing.assert_close(got, torch.tensor(row, dtype=F64) / 100, rtol=0, atol=1e-3, msg=repr(est))
        near_hard = shares[f"{norm}/near_solved"] / shares[f"{norm}/hard"]
        assert near_hard == pytest.approx(ratio, abs=1e-3), repr(est)


@pytest.mark.parametrize("g", [8, 16])
def test_softmax_moves_budget_away_from_near_solved(g):
    """The abstract's reallocation claim: symmetric estimators give near/hard = 1; SoftmaxGRPO's
    near/hard is < 1 and grows with tau, approaching MaxRL's as tau -> 0."""
    for est in (GRPO(), DrGRPO(), RLOO()):
        s = uniform_prior_shares(est, g)
        assert s["l1/near_solved"] == pytest.approx(s["l1/hard"], rel=1e-12)
    ratios = []
    for tau in (0.25, 0.5, 1.0, 2.0):
        s = uniform_prior_shares(SoftmaxGRPO(tau), g)
        ratios.append(s["l1/near_solved"] / s["l1/hard"])
    assert all(a < b < 1 for a, b in zip(ratios, ratios[1:]))
    m = uniform_prior_shares(MaxRL(), g)
    cold = uniform_prior_shares(SoftmaxGRPO(0.01), g)
    assert cold["l1/near_solved"] / cold["l1/hard"] == pytest.approx(m["l1/near_solved"] / m["l1/hard"], rel=1e-9)


# ---------------------------------------------------------------------------------------------
# expected L1 budget at a true pass rate p (G = 8)
# ---------------------------------------------------------------------------------------------

EXPECTED_L1_AT_P = [
    (GRPO(), [1.7581, 5.6858, 6.9432, 5.6858, 1.7581], 1.000),
    (DrGRPO(), [0.6650, 2.6250, 3.5000, 2.6250, 0.6650], 1.000),
    (RLOO(), [0.7600, 3.0000, 4.0000, 3.0000, 0.7600], 1.000),
    (MaxRL(), [4.5853, 10.3982, 7.9375, 3.9998, 0.8000], 0.174),
    (SoftmaxGRPO(0.25), [4.0318, 9.5255, 7.5572, 3.8826, 0.7823], 0.194),
    (SoftmaxGRPO(0.5), [2.1566, 6.0742, 5.6754, 3.2006, 0.6725], 0.312),
    (SoftmaxGRPO(1.0), [0.8996, 2.9982, 3.3033, 2.0923, 0.4696], 0.522),
    (SoftmaxGRPO(2.0), [0.3908, 1.4230, 1.7242, 1.1820, 0.2798], 0.716),
]


@pytest.mark.parametrize(("est", "row", "ratio"), EXPECTED_L1_AT_P, ids=[repr(t[0]) for t in EXPECTED_L1_AT_P])
def test_expected_l1_budget_at_pass_rate(est, row, ratio):
    """E_{K~Bin(8,p)} sum_i |A_i| at p = .05 .25 .5 .75 .95 (1e-3), and the p=.95 : p=.05 ratio.
    By hand, Dr.GRPO: E[2K(8-K)/8] = 2 * 7 p(1-p) = 3.5 at p = 1/2."""
    g = 8
    budget = est.binary_group_advantages(g).abs().sum(-1)  # [G+1], by K
    p = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=F64).unsqueeze(1)
    k = torch.arange(g + 1, dtype=F64)
    pmf = torch.tensor([math.comb(g, j) for j in range(g + 1)], dtype=F64) * p**k * (1 - p) ** (g - k)
    expected = pmf @ budget
    torch.testing.assert_close(expected, torch.tensor(row, dtype=F64), rtol=0, atol=1e-3)
    assert (expected[-1] / expected[0]).item() == pytest.approx(ratio, abs=1e-3)
