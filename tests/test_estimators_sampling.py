"""Theory tests, continued from tests/test_estimators_theory.py: exact expected updates against Monte Carlo (T13) and
the theory a user's new estimator inherits (docs/theory.md §2, docs/objective.md §3-§4)."""

from __future__ import annotations

import math

import pytest
import torch

from estimators import ESTIMATORS, GRPO, RLOO, AdvantageEstimator, DrGRPO, MaxRL, SoftmaxGRPO
from tests.test_estimators_theory import F64, P5, P_GRID
from tests.test_estimators_theory import _one_thread as _one_thread  # one intra-op thread (autouse)

# ---------------------------------------------------------------------------------------------
# T13: Monte Carlo on a single-token Bernoulli-logit policy
# ---------------------------------------------------------------------------------------------

MC_CASES = [
    GRPO(),
    GRPO("population"),
    DrGRPO(),
    RLOO(),
    MaxRL("practical"),
    MaxRL("cv_unbiased"),
    MaxRL("nocv"),
    SoftmaxGRPO(0.25),
    SoftmaxGRPO(1.0),
]


def test_t13_monte_carlo_matches_exact_weight():
    """T13: with one token and logit theta, s_i = r_i - p and grad p = p(1-p), so
    mean over groups of sum_i A_i (r_i - p) / (p(1-p)) estimates c_G(p). M = 60,000 groups per cell,
    G in {4, 8, 16}, p in {.05, .25, .5, .75, .95}; each cell within 5 SE + 0.1%."""
    m = 60_000
    gen = torch.Generator().manual_seed(2608)
    ps = P5.repeat_interleave(m).unsqueeze(1)  # [5M, 1]
    worst = 0.0
    for g in (4, 8, 16):
        r = (torch.rand(5 * m, g, generator=gen, dtype=F64) < ps).to(F64)
        score = (r - ps) / (ps * (1 - ps))  # [5M, G]
        for est in MC_CASES:
            u = (est(r) * score).sum(-1).view(5, m)
            mean, se = u.mean(-1), u.std(-1) / math.sqrt(m)
            exact = est.population_weight(P5, g)
            z = (mean - exact).abs() / (5 * se + 1e-3 * exact.abs())
            worst = max(worst, z.max().item())
            assert (z <= 1).all(), (repr(est), g, mean.tolist(), exact.tolist(), se.tolist())
    assert worst > 0.05  # the statistic is live (identical zeros would pass trivially)


# ---------------------------------------------------------------------------------------------
# a new estimator gets the theory for free
# ---------------------------------------------------------------------------------------------


class HalfRLOO(AdvantageEstimator):
    """Half the leave-one-out advantage: A_i = (r_i - mean_{j != i} r_j) / 2.

    Delta(k) = 1/2 for every k, so c_G(p) = G/2 and F_G(p) = G p / 2.
    """

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        g = rewards.shape[-1]
        others = (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)
        return (rewards - others) / 2


class UnsolvedPenaltyRLOO(AdvantageEstimator):
    """RLOO, plus -1 for every member of an all-zero group (a group-level, K-dependent term).

    Only Delta(0) changes: a_-(0) = -1, so Delta(0) = 1 + 1 = 2. Then
    c_G(p) = G (1 + (1-p)^(G-1)) and F_G(p) = G p + 1 - (1-p)^G (F' = c, F(0) = 0).
    """

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        g = rewards.shape[-1]
        loo = rewards - (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)
        unsolved = (rewards == 0).all(-1, keepdim=True)
        return torch.where(unsolved, -1.0, loo)


@pytest.mark.parametrize("g", [2, 5, 8, 32])
def test_new_estimator_inherits_the_exact_theory(g):
    """A class defined here, outside ESTIMATORS, needs only _advantages for population_weight and
    population_objective to match its closed form (1e-12 relative)."""
    assert HalfRLOO not in ESTIMATORS and UnsolvedPenaltyRLOO not in ESTIMATORS
    p = torch.tensor(P_GRID, dtype=F64)
    half = HalfRLOO()
    torch.testing.assert_close(half.population_weight(p, g), torch.full_like(p, g / 2), rtol=1e-12, atol=0)
    torch.testing.assert_close(half.population_objective(p, g), g * p / 2, rtol=1e-12, atol=0)
    pen = UnsolvedPenaltyRLOO()
    torch.testing.assert_close(pen.population_weight(p, g), g * (1 + (1 - p) ** (g - 1)), rtol=1e-12, atol=0)
    torch.testing.assert_close(pen.population_objective(p, g), g * p + 1 - (1 - p) ** g, rtol=1e-12, atol=1e-15)
    # the group-level term changes c_G: at p -> 0 the penalty doubles RLOO's weight (2G vs G)
    assert pen.population_weight(0.0, g).item() == pytest.approx(2 * RLOO().population_weight(0.0, g).item())


def test_new_estimator_inherits_validation_and_masks():
    """The base class owns input checks, dtype handling and masks for a new estimator as well."""
    est = HalfRLOO()
    with pytest.raises(ValueError, match="finite"):
        est(torch.tensor([[0.0, math.nan]]))
    with pytest.raises(ValueError, match="G must be >= 2"):
        est(torch.zeros(3, 1))
    r = torch.tensor([[1.0, 0.0, 0.0, math.nan]], dtype=torch.float32)
    mask = torch.tensor([[True, True, True, False]])
    a = est(r, mask=mask)
    assert a.dtype == torch.float32
    # three valid members: A = (1 - 0)/2, (0 - 1/2)/2, (0 - 1/2)/2, masked-out 0
    torch.testing.assert_close(a, torch.tensor([[0.5, -0.25, -0.25, 0.0]]))
