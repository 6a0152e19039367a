"""SoftmaxGRPO: softmax-weighted group advantages (arXiv 2608.09271)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator, standardized


class SoftmaxGRPO(AdvantageEstimator):
    """SoftmaxGRPO (arXiv 2608.09271): ``A_i = G * softmax(r / tau)_i - 1``.

    Zero-sum, bounded in [-1, G-1], monotone in r_i; shift invariant and covariant under a joint
    rescale of rewards and temperature (tau is measured in reward units). tau -> 0 gives MaxRL's
    practical estimator on binary rewards; tau -> inf gives Dr.GRPO / tau. Per-rollout expected
    weight is bounded: 0 < c_G(p)/G < e^(1/tau) - 1 for all p and G; the large-group objective is
    the log-MGF ``log E[exp(r / tau)]``.

    Evaluation (spec §3.3) is in float64 with one transcendental pass. The rewards are centred on
    the group maximum *before* dividing by tau, so ``d = (r - max r) / tau <= 0`` carries the
    relative precision of the reward differences (dividing first would amplify the rounding of
    large |r| / tau), and ``u = expm1(d)``. With ``A_i + 1 = e^(d_i) / mean_j e^(d_j)``:

    - spread ``(max r - min r) / tau < 1`` (tau >> range): ``m = mean(u)``, ``A = (u - m) / (1 + m)``,
      full relative precision as tau -> inf (no ``exp(d) - 1`` cancellation);
    - otherwise (tau <~ range): ``e = u + 1``, ``A = e * (G / sum(e)) - 1``; ``sum(e) >= 1``, so
      -1 <= A <= G-1 holds exactly and nothing overflows as tau -> 0.

    Constant groups get exactly 0.

    Only the paper's abstract was available: the definition is inferred so that it satisfies every
    claim of the abstract exactly. Options beyond it: ``scale_by_tau`` multiplies A by tau (Dr.GRPO
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
        rmin, rmax = torch.aminmax(r, dim=-1, keepdim=True)  # [B, 1]
        narrow = (rmax - rmin) / tau < 1  # mean-centred branch; constant groups land here with u = 0
        u = torch.sub(r, rmax).div_(tau).expm1_()  # [B, G], in [-1, 0]
        broad = ~narrow
        if bool(broad.any()):
            u.add_(broad.to(u.dtype))  # e = u + 1 on the max-centred rows
        total = u.sum(-1, keepdim=True)  # sum(u) on narrow rows, sum(e) >= 1 on broad rows
        m = total / g
        # A = u * alpha + beta with per-group alpha, beta (one fused pass)
        alpha = torch.where(narrow, 1 / (1 + m), g / total)
        beta = torch.where(narrow, -m * alpha, -1.0)
        if self.scale_by_tau:
            alpha, beta = alpha * tau, beta * tau
        return torch.addcmul(beta, u, alpha)

    # ------------------------------------------------------------------ large-group theory
    def large_group_weight(self, p: Tensor | float) -> Tensor:
        """lim_{G->inf} c_G(p)/G = (beta - 1) / (1 + p (beta - 1)), beta = e^(1/tau) (spec §4.3).

        Binary rewards; per rollout; times tau with ``scale_by_tau``.
        """
        self._require_canonical("large_group_weight")
        p64 = torch.as_tensor(p, dtype=torch.float64)
        bm1 = math.expm1(1 / self.temperature)
        weight = bm1 / (1 + p64 * bm1)
        return weight * self.temperature if self.scale_by_tau else weight

    def large_group_objective(self, values: Tensor, probs: Tensor) -> Tensor:
        """log E[exp(r / tau)] for a discrete reward law P(r = values[..., j]) = probs[..., j] (spec §4.5).

        E[sum_i A_i s_i] / G -> grad of this as G -> inf. With ``scale_by_tau`` it is multiplied by tau
        (the soft-max value tau log E e^(r/tau), between E[r] and max r). Evaluated with logsumexp.
        """
        self._require_canonical("large_group_objective")
        v = torch.as_tensor(values, dtype=torch.float64)
        q = torch.as_tensor(probs, dtype=torch.float64)
        if v.shape != q.shape:
            raise ValueError(
                f"values and probs must have the same shape, got {tuple(v.shape)} and {tuple(q.shape)}"
            )
        if bool((q < 0).any()) or not torch.allclose(q.sum(-1), torch.ones((), dtype=torch.float64)):
            raise ValueError("probs must be >= 0 and sum to 1 over the last axis")
        value = torch.logsumexp(v / self.temperature + torch.log(q), dim=-1)
        return value * self.temperature if self.scale_by_tau else value

    def _require_canonical(self, what: str) -> None:
        if self.standardize:
            raise ValueError(
                f"{what} is defined for standardize=False; z-scored rewards have no log-MGF form"
            )
