"""Golden values: SoftmaxGRPO's binary advantages and the c_G(p) table of docs/reference_numbers.md §8.1.

Every number below comes from an independent numpy/scipy implementation of the formulas (or by hand, as
noted), not from the library; the
library computes them from its estimators' ``__call__`` alone, through the exact binary theory.
"""

from __future__ import annotations

import math

import pytest
import torch

from estimators import GRPO, RLOO, DrGRPO, MaxRL, SoftmaxGRPO


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


P5 = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
ENDS = torch.tensor([0.0, 1.0], dtype=torch.float64)  # c(0+) and c(1-) are the values at p = 0 and 1

# ---------------------------------------------------------------------------------------------
# the must-shows
# ---------------------------------------------------------------------------------------------


def test_must_show_softmax_weight_tau_1():
    """SoftmaxGRPO(tau = 1).population_weight(p, 8) = 9.4693, 7.9953, 6.6067, 5.5795, 4.9433 (1e-4)."""
    c = SoftmaxGRPO(temperature=1.0).population_weight(P5, 8)
    expected = torch.tensor([9.4693, 7.9953, 6.6067, 5.5795, 4.9433], dtype=torch.float64)
    torch.testing.assert_close(c, expected, rtol=0, atol=1e-4)


def test_must_show_grpo_sample_std_weight():
    """GRPO (sample std, the default) c_8(p) = 18.5067, 15.1621, 13.8865, 15.1621, 18.5067 (1e-4).

    Symmetric in p <-> 1-p and smallest at p = 1/2: GRPO weights easy prompts like hard ones.
    """
    c = GRPO().population_weight(P5, 8)
    expected = torch.tensor([18.5067, 15.1621, 13.8865, 15.1621, 18.5067], dtype=torch.float64)
    torch.testing.assert_close(c, expected, rtol=0, atol=1e-4)


def test_must_show_maxrl_practical_weight():
    """MaxRL practical c_8(p) = 48.2660, 27.7285, 15.8750, 10.6660, 8.4211 (1e-4).

    Hand check at p = 1/2: G (1 - (1-p)^(G-1)) / p = 8 (1 - 2^-7) * 2 = 15.875 exactly.
    """
    c = MaxRL().population_weight(P5, 8)
    expected = torch.tensor([48.2660, 27.7285, 15.8750, 10.6660, 8.4211], dtype=torch.float64)
    torch.testing.assert_close(c, expected, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# T6: golden binary advantages, G = 8 (output file §A)
# ---------------------------------------------------------------------------------------------

# a_+(K) for K = 1..8 and a_-(K) for K = 0..7
GOLDEN_BINARY = {
    0.25: (
        [6.0908817883, 2.7916599753, 1.587675128, 0.9640275801, 0.5826081128, 0.325242446, 0.1398746382, 0.0],
        [0.0, -0.8701259698, -0.9305533251, -0.9526050768, -0.9640275801, -0.9710135213, -0.9757273379, -0.9791224677],
    ),
    0.5: (
        [3.1081533344, 1.8449383769, 1.175878183, 0.761594156, 0.4798356166, 0.2757806227, 0.1211806709, 0.0],
        [0.0, -0.4440219049, -0.614979459, -0.7055269098, -0.761594156, -0.7997260277, -0.8273418681, -0.8482646963],
    ),
    1.0: (
        [1.237664539, 0.9014675457, 0.6530984459, 0.4621171573, 0.3106936512, 0.1876909699, 0.0857940964, 0.0],
        [0.0, -0.1768092199, -0.3004891819, -0.3918590675, -0.4621171573, -0.517822752, -0.5630729097, -0.6005586746],
    ),
    2.0: (
        [0.5250543696, 0.4186449776, 0.3261163213, 0.2449186624, 0.1730907105, 0.1090991253, 0.051727832, 0.0],
        [0.0, -0.0750077671, -0.1395483259, -0.1956697928, -0.2449186624, -0.2884845175, -0.3272973759, -0.3620948242],
    ),
}


@pytest.mark.parametrize("tau", sorted(GOLDEN_BINARY))
def test_golden_softmax_binary_advantages_g8(tau):
    """T6 (1e-9). By hand at tau = 1: a lone success gets 8e/(e+7) - 1 = 1.2376645, each of the
    seven failures 8/(e+7) - 1 = -0.1768092; at K = 4 a_+ = -a_- = tanh(1/2) = 0.4621172."""
    table = SoftmaxGRPO(tau).binary_group_advantages(8)
    a_plus, a_minus = (torch.tensor(v, dtype=torch.float64) for v in GOLDEN_BINARY[tau])
    torch.testing.assert_close(table[1:, 0], a_plus, rtol=0, atol=1e-9)
    torch.testing.assert_close(table[:-1, -1], a_minus, rtol=0, atol=1e-9)


def test_hand_computed_softmax_values():
    e = math.e
    table = SoftmaxGRPO(1.0).binary_group_advantages(8)
    assert table[1, 0].item() == pytest.approx(8 * e / (e + 7) - 1, abs=1e-14)  # 1.2376645390
    assert table[1, 1].item() == pytest.approx(8 / (e + 7) - 1, abs=1e-14)  # -0.1768092199
    assert table[4, 0].item() == pytest.approx(math.tanh(0.5), abs=1e-14)  # 0.4621171573
    # G = 2, one success: A = (2 e^(1/tau) / (e^(1/tau) + 1) - 1) = tanh(1/(2 tau)) and its negative
    two = SoftmaxGRPO(0.5)(torch.tensor([[1.0, 0.0]], dtype=torch.float64))[0]
    torch.testing.assert_close(two, torch.tensor([math.tanh(1.0), -math.tanh(1.0)], dtype=torch.float64))


@pytest.mark.parametrize("g", [2, 3, 8, 16, 64])
def test_binary_advantages_closed_forms(g):
    """§2 and §3.1 closed forms of a_+(K), a_-(K) for every estimator (1e-12)."""
    k = torch.arange(g + 1, dtype=torch.float64)
    kp, km = k[1:], k[:-1]  # K for a_+ (1..G) and for a_- (0..G-1)

    def check(est, a_plus, a_minus):
        table = est.binary_group_advantages(g)
        torch.testing.assert_close(table[1:, 0], a_plus, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(table[:-1, -1], a_minus, rtol=1e-12, atol=1e-12)

    def zero_at_constant(a_plus, a_minus):
        a_plus[-1], a_minus[0] = 0.0, 0.0  # K = G and K = 0 are constant groups
        return a_plus, a_minus

    # GRPO, population std, eps = 0: a_+ = sqrt((G-K)/K), a_- = -sqrt(K/(G-K)); sample: x sqrt((G-1)/G)
    pop = zero_at_constant(((g - kp) / kp).sqrt(), -(km / (g - km)).sqrt())
    check(GRPO("population", eps=0.0), *pop)
    check(GRPO("sample", eps=0.0), *(x * math.sqrt((g - 1) / g) for x in pop))
    check(DrGRPO(), *zero_at_constant(1 - kp / g, -km / g))
    check(RLOO(), *zero_at_constant((g - kp) / (g - 1), -km / (g - 1)))
    # MaxRL: a_+ = G/K - 1 and a_- = -1 when K >= 1; K = 0 gives 0 (practical) or -1 (cv_unbiased)
    practical = zero_at_constant(g / kp - 1, -torch.ones(g, dtype=torch.float64))
    check(MaxRL("practical"), *practical)
    check(MaxRL("cv_unbiased"), practical[0], torch.full((g,), -1.0, dtype=torch.float64))
    nocv_plus = g / kp
    check(MaxRL("nocv"), nocv_plus, torch.zeros(g, dtype=torch.float64))
    # SoftmaxGRPO: lambda = (e^(1/tau) - 1)/G, a_+ = (G-K) lambda/(1 + K lambda), a_- = -K lambda/(1 + K lambda)
    for tau in (0.25, 1.0, 3.0):
        lam = math.expm1(1 / tau) / g
        check(SoftmaxGRPO(tau), (g - kp) * lam / (1 + kp * lam), -km * lam / (1 + km * lam))


# ---------------------------------------------------------------------------------------------
# T12: the §5 table of c_G(p), G = 8 (every row)
# ---------------------------------------------------------------------------------------------

#: rows of docs/reference_numbers.md §8.1's table: c_8(p) at p = .05 .25 .5 .75 .95, then c(0+), c(1-)
TABLE_5 = [
    (GRPO("population", eps=0.0), [19.7845, 16.2089, 14.8452, 16.2089, 19.7845], [21.166, 21.166]),
    (GRPO("sample", eps=0.0), [18.5067, 15.1621, 13.8865, 15.1621, 18.5067], [19.799, 19.799]),
    (DrGRPO(), [7, 7, 7, 7, 7], [7, 7]),
    (RLOO(), [8, 8, 8, 8, 8], [8, 8]),
    (MaxRL("practical"), [48.2660, 27.7285, 15.8750, 10.6660, 8.4211], [56, 8]),
    (MaxRL("cv_unbiased"), [53.8527, 28.7964, 15.9375, 10.6665, 8.4211], [64, 8]),
    (MaxRL("nocv"), [53.8527, 28.7964, 15.9375, 10.6665, 8.4211], [64, 8]),
    (SoftmaxGRPO(0.25), [42.4402, 25.4014, 15.1144, 10.3535, 8.2346], [48.727, 7.833]),
    (SoftmaxGRPO(0.5), [22.7013, 16.1979, 11.3507, 8.5348, 7.0785], [24.865, 6.786]),
    (SoftmaxGRPO(1.0), [9.4693, 7.9953, 6.6067, 5.5795, 4.9433], [9.901, 4.804]),
    (SoftmaxGRPO(2.0), [4.1139, 3.7946, 3.4484, 3.1520, 2.9449], [4.200, 2.897]),
    (SoftmaxGRPO(4.0), [1.9011, 1.8283, 1.7435, 1.6651, 1.6065], [1.920, 1.592]),
]


@pytest.mark.parametrize(("est", "row", "ends"), TABLE_5, ids=[repr(t[0]) for t in TABLE_5])
def test_table5_population_weight_g8(est, row, ends):
    """Spot values of docs/reference_numbers.md §8.1 (1e-4 absolute; the endpoints are printed to 3 decimals, so 1e-3).

    Hand checks: GRPO pop c(0+) = G sqrt(G-1) = 8 sqrt(7) = 21.166; sample (G-1) sqrt(G) = 7 sqrt(8)
    = 19.799; MaxRL practical c(0+) = G (G-1) = 56, cv_unbiased G^2 = 64, c(1-) = G = 8; softmax
    c(0+) = G (G-1)(beta-1)/(G+beta-1) = 56 (e-1)/(e+7) = 9.901 at tau = 1.
    """
    torch.testing.assert_close(est.population_weight(P5, 8), torch.tensor(row, dtype=torch.float64), rtol=0, atol=1e-4)
    torch.testing.assert_close(
        est.population_weight(ENDS, 8), torch.tensor(ends, dtype=torch.float64), rtol=0, atol=1e-3
    )


def test_table5_grpo_default_eps_is_within_table_precision():
    """The default eps = 1e-6 moves GRPO's weights by ~1e-5 relative: still the §5 values at 1e-4."""
    for std, row in (("population", TABLE_5[0][1]), ("sample", TABLE_5[1][1])):
        c = GRPO(std).population_weight(P5, 8)
        torch.testing.assert_close(c, torch.tensor(row, dtype=torch.float64), rtol=0, atol=1e-4)
        assert (c < GRPO(std, eps=0.0).population_weight(P5, 8)).all()  # eps only shrinks A


def test_population_weight_shapes_and_validation():
    est = SoftmaxGRPO(1.0)
    assert est.population_weight(0.5, 8).shape == ()
    assert est.population_weight(P5.reshape(5, 1), 8).shape == (5, 1)
    for bad_p in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="pass rate"):
            est.population_weight(bad_p, 8)
    for bad_g in (1, 0, 2.5):
        with pytest.raises(ValueError, match="group_size"):
            est.population_weight(0.5, bad_g)
