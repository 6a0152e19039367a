"""Conformance suite: every class in ``estimators.ESTIMATORS`` must pass these (docs/theory.md §2.7,
docs/reference_numbers.md §8.2).

The suite is parametrised over the export list, so a new estimator is covered by adding it to
``ESTIMATORS``. Classes whose constructor needs arguments, or that deviate from a property on
purpose (MaxRL's ``cv_unbiased`` / ``nocv`` on constant groups, MaxRL's lack of shift invariance),
are declared in the helpers below; anything not declared is held to the default: zero-sum, exact
zeros on constant groups, shift invariance, and signed rewards (unless the class sets
``requires_nonnegative_rewards``). A class that does not declare how it scales is skipped by the
scale-covariance test only.
"""

from __future__ import annotations

import math

import pytest
import torch

import estimators
from estimators import ESTIMATORS, GRPO, RLOO, AdvantageEstimator, DrGRPO, MaxRL, SoftmaxGRPO


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are small: one intra-op thread is fastest, and robust on a shared 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# the instances under test
# ---------------------------------------------------------------------------------------------

#: constructor arguments per class; a class not listed here is built with no arguments
VARIANTS: dict[type[AdvantageEstimator], list[dict]] = {
    GRPO: [{}, {"std": "population"}, {"std": "sample", "eps": 0.0}],
    MaxRL: [{"variant": "practical"}, {"variant": "cv_unbiased"}, {"variant": "nocv"}],
    SoftmaxGRPO: [
        {"temperature": 1e-3},
        {"temperature": 0.25},
        {"temperature": 0.5},
        {"temperature": 1.0},
        {"temperature": 4.0},
        {"temperature": 1e4},
        {"temperature": 0.5, "scale_by_tau": True},
        {"temperature": 1.0, "standardize": True},
        {"temperature": None, "temperature_rule": "ess", "target_ess": 0.5},
        {"temperature": None, "temperature_rule": "ess", "target_ess": 0.9},
    ],
}
CASES = [cls(**kwargs) for cls in ESTIMATORS for kwargs in VARIANTS.get(cls, [{}])]
IDS = [repr(est) for est in CASES]
SOFTMAX_TAUS = [1e-4, 1e-3, 0.05, 0.25, 0.5, 1.0, 4.0, 100.0, 1e8]


def zero_sum_exempt(est: AdvantageEstimator) -> bool:
    """nocv is r/mu (sum G); the other declared estimators are zero-sum (cv_unbiased off K = 0)."""
    return isinstance(est, MaxRL) and est.variant == "nocv"


def constant_group_value(est: AdvantageEstimator, value: float) -> float:
    """The advantage of every member of a constant group (docs/theory.md §2.1: 0 unless a variant says so)."""
    if isinstance(est, MaxRL) and est.variant == "cv_unbiased":
        return -1.0 if value == 0 else 0.0  # the control variate is kept when K = 0
    if isinstance(est, MaxRL) and est.variant == "nocv":
        return 0.0 if value == 0 else 1.0  # r_i / mu = 1
    return 0.0


def shift_invariant(est: AdvantageEstimator) -> bool:
    return not isinstance(est, MaxRL)  # MaxRL divides by the mean


def random_rewards(est: AdvantageEstimator, batch: int, g: int, seed: int) -> torch.Tensor:
    """A float64 batch mixing binary, uniform, tied (3-level) and constant groups.

    Non-negative for estimators that require it, signed (in [-1, 2]) otherwise.
    """
    gen = torch.Generator().manual_seed(seed)
    quarter = max(batch // 4, 1)
    binary = (torch.rand(quarter, g, generator=gen) < torch.rand(quarter, 1, generator=gen)).double()
    uniform = torch.rand(quarter, g, generator=gen, dtype=torch.float64)
    tied = torch.randint(0, 3, (quarter, g), generator=gen).double() / 2
    constant = torch.rand(quarter, 1, generator=gen, dtype=torch.float64).expand(quarter, g)
    r = torch.cat([binary, uniform, tied, constant])
    if not est.requires_nonnegative_rewards:
        r = 3 * r - 1
    return r


def norm_scale(a: torch.Tensor) -> float:
    return max(1.0, a.abs().max().item())


# ---------------------------------------------------------------------------------------------
# the export list itself
# ---------------------------------------------------------------------------------------------


def test_export_list_is_complete_and_consistent():
    assert len(ESTIMATORS) == len(set(ESTIMATORS)) >= 5
    for cls in ESTIMATORS:
        assert issubclass(cls, AdvantageEstimator)
        assert cls.__name__ in estimators.__all__
        assert getattr(estimators, cls.__name__) is cls
    # every class with declared variants is exported, so no declaration is stale
    assert set(VARIANTS) <= set(ESTIMATORS)
    assert {type(est) for est in CASES} == set(ESTIMATORS)


# ---------------------------------------------------------------------------------------------
# T1 zero-sum, T2 constant groups
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_zero_sum(est):
    """T1: |sum_i A_i| <= 1e-12 G (scaled by the advantages' size; cv_unbiased off K = 0)."""
    if zero_sum_exempt(est):
        pytest.skip("MaxRL nocv is r/mu: its advantages sum to G, by definition")
    for g in (2, 3, 8, 16, 64):
        r = random_rewards(est, 400, g, seed=g)
        a = est(r)
        if isinstance(est, MaxRL) and est.variant == "cv_unbiased":
            solved = r.amax(-1) > 0
            assert torch.equal(a[~solved], torch.full_like(a[~solved], -1.0))
            a = a[solved]
        assert a.sum(-1).abs().max().item() <= 1e-12 * g * norm_scale(a), g


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_constant_groups_give_exact_values(est):
    """T2: all-equal groups give exactly 0 (cv_unbiased: -1 at K = 0; nocv: 1), mixed in a batch."""
    values = [0.0, 1.0, 0.37, 0.1, 1e6, 1e-300, 123.456]
    if not est.requires_nonnegative_rewards:
        values += [-2.5, -0.1]
    gen = torch.Generator().manual_seed(0)
    expected = torch.tensor([constant_group_value(est, v) for v in values], dtype=torch.float64)
    for g in (2, 5, 16):
        noisy = torch.rand(len(values), g, generator=gen, dtype=torch.float64)  # non-constant neighbours
        const = torch.tensor(values, dtype=torch.float64).unsqueeze(1).expand(-1, g)
        a = est(torch.cat([const, noisy]))[: len(values)]
        assert torch.equal(a, expected.unsqueeze(1).expand(-1, g)), a
        # alone in its batch as well (no dependence on the rest of the batch)
        assert torch.equal(est(const), expected.unsqueeze(1).expand(-1, g))


# ---------------------------------------------------------------------------------------------
# T3 softmax bounds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", SOFTMAX_TAUS)
def test_softmax_bounds(tau):
    """T3: -1 <= A_i <= G-1 exactly; A_i > -1 whenever (max r - r_i)/tau < 30."""
    for g in (2, 3, 7, 64, 1024):
        gen = torch.Generator().manual_seed(g)
        lone = torch.zeros(1, g, dtype=torch.float64)
        lone[0, 0] = 1.0  # one success: the most extreme advantage, G/(1 + (G-1) e^(-1/tau)) - 1
        scale = torch.logspace(-6, 6, 13, dtype=torch.float64).unsqueeze(1)
        r = torch.cat([lone, torch.rand(13, g, generator=gen, dtype=torch.float64) * scale - scale / 3])
        a = SoftmaxGRPO(tau)(r)
        assert torch.isfinite(a).all()
        assert (a >= -1).all() and (a <= g - 1).all()
        close = (r.amax(-1, keepdim=True) - r) / tau < 30
        assert (a[close] > -1).all()
        # the lone success's advantage is positive; for tau -> 0 it reaches G-1 but never exceeds it
        assert 0 < a[0, 0] <= g - 1


# ---------------------------------------------------------------------------------------------
# T4 shift invariance, scale covariance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_shift_invariance(est):
    """T4: A(r + c) = A(r) for |c| <= 10 (1e-9), for the shift-invariant estimators."""
    if not shift_invariant(est):
        pytest.skip(f"{type(est).__name__} divides by the group mean: not shift invariant")
    r = random_rewards(est, 400, 8, seed=1)
    a = est(r)
    for shift in (-10.0, -0.5, 3.0, 10.0):
        torch.testing.assert_close(est(r + shift), a, rtol=0, atol=1e-9 * norm_scale(a))


#: how each class scales: A(a r) = a^degree A(r); GRPO's eps and SoftmaxGRPO's tau rescale jointly
SCALE_DEGREE = {GRPO: 0, DrGRPO: 1, RLOO: 1, MaxRL: 0}


def rescaled(est: AdvantageEstimator, factor: float) -> tuple[AdvantageEstimator, int]:
    """(the estimator to apply to factor * r, the degree d with A' = factor^d A)."""
    if isinstance(est, SoftmaxGRPO) and est.temperature_rule == "ess":
        return est, 0  # tau is chosen per group in reward units: A(a r) = A(r)
    if isinstance(est, SoftmaxGRPO):
        # A(a r, a tau) = A(r, tau); scale_by_tau multiplies by tau, so it gains one degree;
        # z-scores are scale invariant, so a standardized softmax keeps tau
        tau = est.temperature if est.standardize else est.temperature * factor
        return SoftmaxGRPO(tau, est.scale_by_tau, est.standardize), int(est.scale_by_tau)
    if isinstance(est, GRPO):
        return GRPO(est.std, est.eps * factor), 0  # eps is in reward units too
    if type(est) not in SCALE_DEGREE:
        pytest.skip(f"declare how {type(est).__name__} scales in SCALE_DEGREE")
    return est, SCALE_DEGREE[type(est)]


@pytest.mark.parametrize("est", CASES, ids=IDS)
@pytest.mark.parametrize("factor", [0.01, 1000.0])
def test_scale_covariance(est, factor):
    """T4: A(a r) = a^d A(r) (MaxRL d = 0; Dr.GRPO, RLOO d = 1; GRPO d = 0 with eps -> a eps);
    softmax: A(a r, a tau) = A(r, tau) (1e-9)."""
    r = random_rewards(est, 400, 8, seed=2)
    a = est(r)
    other, degree = rescaled(est, factor)
    expected = a * factor**degree
    torch.testing.assert_close(other(r * factor), expected, rtol=0, atol=1e-9 * norm_scale(expected))


# ---------------------------------------------------------------------------------------------
# T5 permutation equivariance, ties, monotonicity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_permutation_equivariance(est):
    """T5: permuting a group's rewards permutes its advantages (1e-12)."""
    r = random_rewards(est, 400, 16, seed=3)
    perm = torch.rand(r.shape, generator=torch.Generator().manual_seed(4)).argsort(-1)
    a = est(r)
    torch.testing.assert_close(est(r.gather(-1, perm)), a.gather(-1, perm), rtol=0, atol=1e-12 * norm_scale(a))


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_ties_get_equal_advantages(est):
    """T5: equal rewards in a group get equal advantages (1e-12)."""
    gen = torch.Generator().manual_seed(5)
    r = torch.randint(0, 3, (300, 12), generator=gen).double() * 0.37  # three levels: many ties
    a = est(r)
    for level in (0.0, 0.37, 0.74):
        at_level = r == level
        hi = torch.where(at_level, a, -math.inf).amax(-1)
        lo = torch.where(at_level, a, math.inf).amin(-1)
        has = at_level.any(-1)
        assert ((hi - lo)[has] <= 1e-12 * norm_scale(a)).all()


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_monotone_in_own_reward(est):
    """T5: r_i > r_j implies A_i >= A_j (1e-12): sorted rewards give sorted advantages."""
    r = random_rewards(est, 400, 16, seed=6).sort(-1).values
    a = est(r)
    assert (a.diff(dim=-1) >= -1e-12 * norm_scale(a)).all()
    # and the ordering is informative: the top reward beats the bottom one in non-constant groups
    varied = r[:, -1] > r[:, 0]
    assert (a[varied, -1] > a[varied, 0]).all()
