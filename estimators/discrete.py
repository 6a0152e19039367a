"""Exact expected update for rewards with finitely many values, and its curl (docs/objective.md §3.4).

A reward takes the values ``levels[v]`` with law ``q`` (one softmax policy over V outcomes, logits
theta, ``q = softmax(theta)``). For a symmetric estimator the expected update of one group is

    E[U] = sum_v g_G(v) grad_theta q_v = J g,   J = diag(q) - q q^T,
    g_G(v) = G E[A_1 | r_1 = levels[v]]   (the other G-1 rewards i.i.d. from q),

computed here by exact enumeration of the multinomial counts of the other G-1 rewards (float64, no
sampling). ``E[U]`` is the gradient of some objective of the reward law iff the 1-form
``omega = sum_v g_G(v) dq_v`` is closed on the simplex. For V = 3, in the coordinates (q_1, q_2) with
q_0 = 1 - q_1 - q_2, ``omega = h_1 dq_1 + h_2 dq_2`` with ``h_j = g_j - g_0``, and its curl is

    curl = dh_2/dq_1 - dh_1/dq_2,   d/dq_j = partial_j - partial_0,

zero everywhere iff a scalar objective exists. ``loop_integral`` integrates omega around a circle in
the simplex from the values of g alone, so Stokes' theorem (loop integral = area integral of the curl)
checks the derivatives independently.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator, as_float64

F64 = torch.float64


def compositions(n: int, parts: int) -> Tensor:
    """All count vectors of ``parts`` non-negative integers summing to ``n``: int64 ``[C, parts]``."""
    if parts == 1:
        return torch.tensor([[n]], device="cpu")  # small host tables throughout this module
    rows = [torch.cat([torch.full((len(rest), 1), first, device="cpu"), rest], 1)
            for first in range(n, -1, -1) for rest in [compositions(n - first, parts - 1)]]  # fmt: skip
    return torch.cat(rows)


def level_advantages(est: AdvantageEstimator, levels: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``(counts [C, V], adv [V, C])``: ``adv[v, c]`` is A_1 when r_1 = levels[v] and the other G-1
    rewards hold ``counts[c]`` of each level, from the estimator's own ``__call__``."""
    counts = compositions(group_size - 1, len(levels))  # [C, V]
    return counts, _first_member_advantages(est, levels, counts)


def _first_member_advantages(est: AdvantageEstimator, levels: Tensor, counts: Tensor) -> Tensor:
    """``[V, C]``: A_1 of the group (levels[v], then counts[c] of each level), float64."""
    lv = as_float64(levels).cpu()
    n_others = int(counts[0].sum())
    others = lv.repeat(len(counts)).repeat_interleave(counts.flatten()).view(len(counts), n_others)
    groups = [torch.cat([lv[v].expand(len(counts), 1), others], 1) for v in range(len(lv))]
    return torch.stack([est(group)[:, 0] for group in groups]).to(F64)


def multinomial_pmf(counts: Tensor, q: Tensor) -> Tensor:
    """P(counts) under Multinomial(sum(counts), q): ``q.shape[:-1] + [C]``, float64, exact at q = 0."""
    n = counts.to(F64)
    log_coef = math.lgamma(int(counts[0].sum()) + 1) - torch.lgamma(n + 1).sum(-1)  # [C]
    return torch.exp(log_coef + torch.xlogy(n, q.unsqueeze(-2)).sum(-1))


def level_weights(est: AdvantageEstimator, levels: Tensor, probs: Tensor, group_size: int,
                  min_prob: float = 0.0) -> Tensor:  # fmt: skip
    """``g_G(v) = G E[A_1 | r_1 = levels[v]]``: ``probs.shape``, float64 (``probs [..., V]`` sums to 1).

    ``min_prob > 0`` skips the count vectors less likely than that at every given law (for large G);
    the error is then at most ``G max|A| C min_prob`` with C the number of count vectors.
    """
    q = as_float64(probs).cpu()
    if q.shape[-1] != len(levels) or bool((q < 0).any()) or not torch.allclose(q.sum(-1), q.new_ones(())):
        raise ValueError(f"probs must be a law on the levels: shape [..., {len(levels)}], >= 0, summing to 1")
    counts = compositions(group_size - 1, q.shape[-1])
    if min_prob > 0:
        keep = multinomial_pmf(counts, q.reshape(-1, q.shape[-1])).amax(0) >= min_prob
        counts = counts[keep]
    return group_size * multinomial_pmf(counts, q) @ _first_member_advantages(est, levels, counts).T


def expected_update(est: AdvantageEstimator, levels: Tensor, logits: Tensor, group_size: int) -> Tensor:
    """Exact ``E[sum_i A_i grad_theta log softmax(theta)[y_i]]`` for logits ``theta [..., V]``: ``J g``."""
    q = torch.softmax(as_float64(logits).cpu(), -1)
    g = level_weights(est, levels, q, group_size)
    return q * g - q * (q * g).sum(-1, keepdim=True)


def simplex_jacobian(est: AdvantageEstimator, levels: Tensor, probs: Tensor, group_size: int) -> Tensor:
    """``D[..., j, k] = dh_{j+1}/dq_{k+1}`` on the simplex (V = 3, ``probs`` inside it): ``[..., 2, 2]``.

    g_G is a polynomial in q; its free partials ``partial_u g_v = G sum_c adv[v, c] pmf_c n_{c,u} / q_u``
    are exact, and ``d/dq_j = partial_j - partial_0``, ``h_j = g_j - g_0``.
    """
    q = as_float64(probs).cpu()
    if q.shape[-1] != 3 or not bool((q > 0).all()):
        raise ValueError("simplex_jacobian needs 3 reward levels and probabilities > 0 (inside the simplex)")
    counts, adv = level_advantages(est, levels, group_size)  # [C, 3], [3, C]
    pmf = multinomial_pmf(counts, q)  # [..., C]
    partial = group_size * torch.einsum("...c,cu,vc->...vu", pmf, counts.to(F64), adv) / q.unsqueeze(-2)  # [..., v, u]
    h = partial[..., 1:, :] - partial[..., :1, :]  # [..., j, u]: partials of h_j = g_j - g_0
    return h[..., 1:] - h[..., :1]  # [..., j, k]: d/dq_k = partial_k - partial_0


def simplex_curl(est: AdvantageEstimator, levels: Tensor, probs: Tensor, group_size: int) -> Tensor:
    """``curl = dh_2/dq_1 - dh_1/dq_2`` of the expected update's 1-form (module docstring): ``probs.shape[:-1]``."""
    d = simplex_jacobian(est, levels, probs, group_size)
    return d[..., 1, 0] - d[..., 0, 1]


def relative_curl(est: AdvantageEstimator, levels: Tensor, probs: Tensor, group_size: int) -> Tensor:
    """``|curl| / ||D||_F``: the antisymmetric part of the Jacobian D relative to D itself (scale free:
    0 for a gradient field, at most sqrt(2))."""
    d = simplex_jacobian(est, levels, probs, group_size)
    return (d[..., 1, 0] - d[..., 0, 1]).abs() / torch.linalg.matrix_norm(d)


def loop_integral(est: AdvantageEstimator, levels: Tensor, center: Tensor, radius: float, group_size: int,
                  points: int = 256) -> Tensor:  # fmt: skip
    """``oint omega`` counter-clockwise around the circle of ``radius`` about ``center = (q_1, q_2)``.

    omega restricted to the circle is a trigonometric polynomial of degree <= G, so the periodic
    trapezoid rule with ``points > G`` nodes is exact up to rounding.
    """
    phi = torch.arange(points, dtype=F64, device="cpu") * (2 * math.pi / points)
    c = as_float64(center).cpu()
    q12 = c + radius * torch.stack([phi.cos(), phi.sin()], -1)  # [N, 2]
    q = torch.cat([1 - q12.sum(-1, keepdim=True), q12], -1)  # [N, 3]
    g = level_weights(est, levels, q, group_size)
    h = g[:, 1:] - g[:, :1]  # [N, 2]
    tangent = radius * torch.stack([-phi.sin(), phi.cos()], -1)  # dq/dphi
    return (h * tangent).sum(-1).mean() * 2 * math.pi
