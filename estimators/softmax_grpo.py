"""SoftmaxGRPO: softmax-weighted group advantages (arXiv 2608.09271)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator, as_float64, standardized

#: groups whose spread (max r - min r) / tau lies in (0, this) use the expm1 form (class docstring)
_EXPM1_SPREAD = 1 / 16


class SoftmaxGRPO(AdvantageEstimator):
    """SoftmaxGRPO (arXiv 2608.09271): ``A_i = G * softmax(r / tau)_i - 1``.

    Zero-sum, bounded in [-1, G-1], monotone in r_i; shift invariant and covariant under a joint
    rescale of rewards and temperature (tau is measured in reward units). tau -> 0 gives MaxRL's
    practical estimator on binary rewards; tau -> inf gives Dr.GRPO / tau. Per-rollout expected
    weight is bounded: 0 < c_G(p)/G < e^(1/tau) - 1 for all p and G; the large-group objective is
    the log-MGF ``log E[exp(r / tau)]``.

    Evaluation (docs/theory.md §5.2) is in float64. The rewards are centred on the group maximum *before*
    dividing by tau, so ``d = (r - max r) / tau <= 0`` carries the relative precision of the reward
    differences (dividing first would amplify the rounding of large |r| / tau). With
    ``A_i + 1 = e^(d_i) / mean_j e^(d_j)``, per group:

    - spread ``s = (max r - min r) / tau >= 1/16`` (and constant groups): ``e = exp(d)`` in [0, 1],
      ``A = e * (G / sum(e)) - 1``. ``sum(e) >= 1``, so -1 <= A <= G-1 holds exactly, nothing
      overflows as tau -> 0, and the normwise relative error is ~1e-14 (max|A| >~ s/2);
    - ``0 < s < 1/16`` (tau >> range, A -> 0): ``u = expm1(d)``, ``m = mean(u)``,
      ``A = (u - m) / (1 + m)``, which keeps full relative precision as tau -> inf, where
      ``exp(d) - 1`` would cancel.

    A split at s = 1 would do too; splitting at 1/16 keeps the same accuracy (the exp form is exact to
    ~1e-14 there) and lets the usual groups skip the slower expm1. Constant groups get exactly 0.

    Only the paper's abstract was available: the definition is inferred so that it satisfies every
    claim of the abstract exactly (a form that does, not shown to be the only one: docs/theory.md §2.6).
    Options beyond it: ``scale_by_tau`` multiplies A by tau (Dr.GRPO
    exactly as tau -> inf); ``standardize`` applies the softmax to z-scores (sample std) instead of
    raw rewards (GRPO / tau as tau -> inf).
    """

    def __init__(self, temperature: float, scale_by_tau: bool = False, standardize: bool = False) -> None:
        valid = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
        if not (valid and math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"temperature must be finite and > 0 (in reward units; try 0.5 for rewards in [0, 1]), "
                f"got {temperature!r}"
            )
        self.temperature = float(temperature)
        self.scale_by_tau = scale_by_tau
        self.standardize = standardize

    def _advantages(self, rewards: Tensor) -> Tensor:
        r = standardized(rewards) if self.standardize else rewards
        g, tau = r.shape[-1], self.temperature
        rmax = r.amax(-1, keepdim=True)  # [B, 1]
        spread = (rmax - r.amin(-1, keepdim=True)) / tau
        narrow = (spread < _EXPM1_SPREAD) & (spread > 0)  # [B, 1]: the expm1 form
        n_narrow = int(narrow.sum())
        d = torch.sub(r, rmax).div_(tau)  # [B, G], <= 0
        # A = e * alpha + beta per group: e = exp(d) with alpha = G / sum(e), beta = -1, or
        # e = u = expm1(d) with m = mean(u), alpha = 1 / (1 + m), beta = -m / (1 + m)
        if n_narrow == 0:
            e = d.exp_()
            alpha = g / e.sum(-1, keepdim=True)
            beta = torch.full((), -1.0, dtype=r.dtype, device=r.device)
        elif n_narrow == len(narrow):
            e = d.expm1_()
            m = e.mean(-1, keepdim=True)
            alpha = (m + 1).reciprocal_()
            beta = (m * alpha).neg_()
        else:  # each group gets the same formula as it would alone: results do not depend on the batch
            u = torch.expm1(d)
            e = torch.where(narrow, u, d.exp_())
            total = e.sum(-1, keepdim=True)
            m = total / g
            alpha_u = (m + 1).reciprocal_()
            alpha = torch.where(narrow, alpha_u, g / total)
            beta = torch.where(narrow, (m * alpha_u).neg_(), -1.0)
        if self.scale_by_tau:
            alpha, beta = alpha * tau, beta * tau
        return torch.addcmul(beta, e, alpha)  # one fused pass

    # ------------------------------------------------------------------ large-group theory
    def large_group_weight(self, p: Tensor | float) -> Tensor:
        """lim_{G->inf} c_G(p)/G = (beta - 1) / (1 + p (beta - 1)), beta = e^(1/tau) (docs/theory.md §4.3).

        Binary rewards; per rollout; times tau with ``scale_by_tau``.
        """
        self._require_canonical("large_group_weight")
        p64 = as_float64(p)
        bm1 = math.expm1(1 / self.temperature)
        weight = bm1 / (1 + p64 * bm1)
        return weight * self.temperature if self.scale_by_tau else weight

    def large_group_objective(self, values: Tensor, probs: Tensor) -> Tensor:
        """log E[exp(r / tau)] for a discrete reward law P(r = values[..., j]) = probs[..., j] (docs/theory.md §4.4).

        E[sum_i A_i s_i] / G -> grad of this as G -> inf. With ``scale_by_tau`` it is multiplied by tau
        (the soft-max value tau log E e^(r/tau), between E[r] and max r). Evaluated with logsumexp.
        """
        self._require_canonical("large_group_objective")
        v = as_float64(values)
        q = as_float64(probs).to(v.device)
        if v.shape != q.shape:
            raise ValueError(f"values and probs must have the same shape, got {tuple(v.shape)} and {tuple(q.shape)}")
        if bool((q < 0).any()) or not torch.allclose(q.sum(-1), q.new_ones(())):
            raise ValueError("probs must be >= 0 and sum to 1 over the last axis")
        value = torch.logsumexp(v / self.temperature + torch.log(q), dim=-1)
        return value * self.temperature if self.scale_by_tau else value

    def _require_canonical(self, what: str) -> None:
        if self.standardize:
            raise ValueError(f"{what} is defined for standardize=False; z-scored rewards have no log-MGF form")
