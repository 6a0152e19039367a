"""Discrete (scalar) rewards: the exact expected update of ``estimators/discrete.py`` (docs/objective.md §3.4, §4.4).

T15: the enumerated field against Monte Carlo and its large-group limit, the log-MGF gradient, with
the 1/G rate of the finite-group error. The curl of the field on the reward simplex: zero for the
estimators that optimise expected reward (Dr.GRPO, RLOO), non-zero for GRPO and SoftmaxGRPO (tau 0.5) at
every G = 3..16 checked, whose updates there are therefore the gradient of no objective of the reward law
(a numerical check of those cases, not a proof for every G), with SoftmaxGRPO's curl shrinking as G grows.
Stokes' theorem ties the curl (derivatives of g_G) to loop integrals of g_G alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from estimators import GRPO, RLOO, DrGRPO, MaxRL, SoftmaxGRPO
from estimators.discrete import (
    compositions,
    expected_update,
    level_weights,
    loop_integral,
    relative_curl,
    simplex_curl,
)

F64 = torch.float64
LEVELS = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
THETA = torch.tensor([0.3, -0.2, 0.0], dtype=F64)
TAU = 0.5
#: points inside the simplex (q_0, q_1, q_2): the centre, near each vertex, and off-centre
POINTS = torch.tensor(
    [[1 / 3, 1 / 3, 1 / 3], [0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1]],
    dtype=F64,
)


def log_mgf_gradient(est: SoftmaxGRPO) -> torch.Tensor:
    """grad_theta log E[e^(r/tau)] via autograd through the library's large_group_objective."""
    theta = THETA.clone().requires_grad_(True)
    est.large_group_objective(LEVELS, torch.softmax(theta, 0)).backward()
    return theta.grad


def relative_error(est: SoftmaxGRPO, g: int, target: torch.Tensor, min_prob: float = 0.0) -> float:
    """||E[U]/G - target|| / ||target|| at THETA."""
    q = torch.softmax(THETA, 0)
    w = level_weights(est, LEVELS, q, g, min_prob=min_prob)
    field = q * w - q * (q * w).sum()  # J g, J = diag(q) - q q^T
    return ((field / g - target).norm() / target.norm()).item()


def test_compositions_and_dr_grpo_weights_by_hand():
    """All count vectors are listed once; Dr.GRPO's g_G(v) = G E[v - mean] = (G - 1)(v - E r) (1e-12)."""
    c = compositions(4, 3)
    assert len(c) == math.comb(6, 2) and (c.sum(-1) == 4).all() and len({tuple(r) for r in c.tolist()}) == len(c)
    q = POINTS
    for g in (2, 5, 9):
        mean = (q * LEVELS).sum(-1, keepdim=True)
        torch.testing.assert_close(level_weights(DrGRPO(), LEVELS, q, g), (g - 1) * (LEVELS - mean), rtol=0, atol=1e-12)


def test_t15_exact_scalar_field_matches_monte_carlo():
    """T15: at G = 8 the enumerated field equals Monte Carlo within 5 SE per component
    (exact E[U] = [-2.217994, -0.255718, 2.473713])."""
    est, g, m = SoftmaxGRPO(TAU), 8, 200_000
    q = torch.softmax(THETA, 0)
    exact = expected_update(est, LEVELS, THETA, g)
    torch.testing.assert_close(exact, torch.tensor([-2.217994, -0.255718, 2.473713], dtype=F64), rtol=0, atol=1e-6)
    gen = torch.Generator().manual_seed(15)
    y = torch.multinomial(q, m * g, replacement=True, generator=gen).view(m, g)
    a = est(LEVELS[y])  # [M, G]
    score = torch.nn.functional.one_hot(y, 3).to(F64) - q  # grad_theta log softmax(theta)[y]
    u = (a.unsqueeze(-1) * score).sum(1)  # [M, 3]
    mean, se = u.mean(0), u.std(0) / math.sqrt(m)
    assert ((mean - exact).abs() <= 5 * se).all(), (mean, exact, se)


def test_t15_large_group_field_is_the_log_mgf_gradient():
    """T15: ||E[U]/G - grad log E e^(r/tau)|| / ||grad log E e^(r/tau)|| is 0.28166, 0.059110, 0.013946,
    0.0034373 at G = 4, 16, 64, 256 and <= 0.02 at G = 256; the same for tau-scaled advantages against
    grad[tau log E e^(r/tau)]."""
    est, scaled = SoftmaxGRPO(TAU), SoftmaxGRPO(TAU, scale_by_tau=True)
    target, scaled_target = log_mgf_gradient(est), log_mgf_gradient(scaled)
    torch.testing.assert_close(scaled_target, TAU * target)
    expected = {4: 0.28166, 16: 0.059110, 64: 0.013946, 256: 0.0034373}
    for g, rel in expected.items():
        # at G = 256 skip the count vectors of probability < 1e-16: at most 32,896 of them, mass < 4e-12
        err = relative_error(est, g, target, min_prob=1e-16 if g == 256 else 0.0)
        assert err == pytest.approx(rel, rel=1e-3), g
    assert err <= 0.02
    assert relative_error(scaled, 256, scaled_target, min_prob=1e-16) <= 0.02


def test_finite_group_error_decays_like_one_over_g():
    """The finite-group error of SoftmaxGRPO's expected update (tau 0.5, levels 0 / 0.5 / 1) is
    0.28, 0.13, 0.059, 0.028, 0.014 at G = 4, 8, 16, 32, 64: G * error = 1.13, 1.02, 0.95, 0.91, 0.89.

    Why 1/G: A_1 + 1 = e^(r_1/tau) / (mean of e^(r_j/tau) over the group), a smooth function of a
    sample mean, whose bias is a/G + O(1/G^2) (delta method; the member's own term and the variance of
    the mean both enter at order 1/G). So G * error = a + O(1/G), with a ~ 0.88 here. Bound tested:
    0.8 <= G * error <= 1.2 for every G in 4..64, and halving-G ratios error(G) / error(2G) in
    [1.8, 2.3] for G >= 8. A 1/sqrt(G) rate would make G * error grow 4x over the range, a 1/G^2 rate
    shrink it 16x; either fails both bounds."""
    est = SoftmaxGRPO(TAU)
    target = log_mgf_gradient(est)
    sizes = (4, 8, 16, 32, 64)
    errs = [relative_error(est, g, target) for g in sizes]
    for got, want in zip(errs, (0.28, 0.13, 0.059, 0.028, 0.014)):
        assert got == pytest.approx(want, rel=0.05)
    scaled = [g * e for g, e in zip(sizes, errs)]
    assert all(0.8 <= s <= 1.2 for s in scaled), scaled
    assert all(1.8 <= errs[i] / errs[i + 1] <= 2.3 for i in range(1, len(sizes) - 1)), errs
    assert all(a > b for a, b in zip(scaled, scaled[1:]))  # approaching a from above: a smooth O(1/G) correction


# ---------------------------------------------------------------------------------------------
# the curl of the expected update on the reward simplex
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", [DrGRPO(), RLOO()], ids=repr)
def test_expected_reward_estimators_have_zero_curl(est):
    """Dr.GRPO and RLOO are the gradient of (G - 1) E[r] and G E[r]: their curl is 0 to 1e-10 (relative
    to G) and every loop integral vanishes, for G = 3..16 at every test point."""
    for g in range(3, 17):
        assert simplex_curl(est, LEVELS, POINTS, g).abs().max().item() <= 1e-10 * g
        assert abs(loop_integral(est, LEVELS, POINTS[0, 1:], 0.2, g).item()) <= 1e-10 * g


def test_grpo_has_curl_at_every_group_size():
    """GRPO's field is far from a gradient: |curl| / ||D||_F (0 for a gradient field, at most sqrt 2)
    is at least 0.5 at every test point for G = 3..16 (measured 0.65 to 1.41)."""
    for g in range(3, 17):
        rel = relative_curl(GRPO(), LEVELS, POINTS, g)
        assert (rel >= 0.5).all(), (g, rel.tolist())


def test_softmax_curl_is_nonzero_and_shrinks_with_the_group():
    """SoftmaxGRPO tau 0.5: no objective at G = 3..16 (relative curl >= 0.01 at every point; larger G unchecked),
    but the curl shrinks towards the curl-free log-MGF limit: strictly decreasing in G at every point,
    from 0.26-0.65 at G = 3 to 0.014-0.057 at G = 16 (at least 10x), and always below GRPO's."""
    est = SoftmaxGRPO(TAU)
    rel = torch.stack([relative_curl(est, LEVELS, POINTS, g) for g in range(3, 17)])  # [14, points]
    assert (rel >= 0.01).all()
    assert (rel.diff(dim=0) < 0).all()
    assert (rel[-1] <= rel[0] / 10).all(), (rel[0].tolist(), rel[-1].tolist())
    grpo = torch.stack([relative_curl(GRPO(), LEVELS, POINTS, g) for g in range(3, 17)])
    assert (rel < grpo).all()
    # MaxRL has curl too (at G = 8). On these scalar levels MaxRL is r / mean - 1, not SoftmaxGRPO's tau -> 0
    # hard max: the two coincide on binary rewards only
    assert (relative_curl(MaxRL(), LEVELS, POINTS, 8) >= 0.01).all()


def disk_integral_of_curl(est, center: torch.Tensor, radius: float, g: int) -> float:
    """Area integral of the curl over a disk: Gauss-Legendre in r, trapezoid in phi, both exact for
    the polynomial curl (degree <= G - 2 in q)."""
    nodes, weights = np.polynomial.legendre.leggauss(g + 2)
    r = torch.tensor((nodes + 1) / 2 * radius, dtype=F64)  # [R]
    wr = torch.tensor(weights / 2 * radius, dtype=F64)
    phi = torch.arange(2 * g + 4, dtype=F64) * (2 * math.pi / (2 * g + 4))
    q12 = center + r.view(-1, 1, 1) * torch.stack([phi.cos(), phi.sin()], -1)  # [R, P, 2]
    q = torch.cat([1 - q12.sum(-1, keepdim=True), q12], -1)
    curl = simplex_curl(est, LEVELS, q, g)  # [R, P]
    return ((curl.mean(-1) * 2 * math.pi) * r * wr).sum().item()


@pytest.mark.parametrize("est", [GRPO(), SoftmaxGRPO(TAU), SoftmaxGRPO(0.2), MaxRL()], ids=repr)
def test_stokes_loop_integral_equals_the_area_integral_of_the_curl(est):
    """The closed-loop integral of omega (values of g_G only) equals the area integral of the curl (its
    exact derivatives) over the enclosed disk, to 1e-10 relative, at G = 3, 8, 16: the two
    computations check each other, and a non-zero loop integral is a direct witness of no objective."""
    center = torch.tensor([0.3, 0.35], dtype=F64)
    for g in (3, 8, 16):
        loop = loop_integral(est, LEVELS, center, 0.2, g).item()
        area = disk_integral_of_curl(est, center, 0.2, g)
        assert loop == pytest.approx(area, rel=1e-10), (g, loop, area)
        assert abs(loop) > 1e-3


def test_curl_needs_three_levels_inside_the_simplex():
    with pytest.raises(ValueError, match="law on the levels"):
        level_weights(GRPO(), LEVELS, torch.tensor([0.7, 0.4, -0.1], dtype=F64), 4)
    with pytest.raises(ValueError, match="inside the simplex"):
        simplex_curl(GRPO(), LEVELS, torch.tensor([0.5, 0.5, 0.0], dtype=F64), 4)
    with pytest.raises(ValueError, match="3 reward levels"):
        simplex_curl(GRPO(), torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), 4)
