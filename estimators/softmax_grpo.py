"""SoftmaxGRPO: softmax-weighted group advantages (arXiv 2608.09271)."""

from __future__ import annotations

import math
import numbers
from typing import Literal

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator, as_float64, standardized

#: groups whose spread (max r - min r) / tau lies in (0, this) use the expm1 form (class docstring)
_EXPM1_SPREAD = 1 / 16
#: the ESS rule searches tau / spread in [2^-20, 2^20] by this many bisection steps on its log
_ESS_LOG_RANGE, _ESS_STEPS = 20 * math.log(2), 64


class SoftmaxGRPO(AdvantageEstimator):
    """SoftmaxGRPO (arXiv 2608.09271): ``A_i = G * softmax(r / tau)_i - 1``.

    Zero-sum, bounded in [-1, G-1], monotone in r_i; shift invariant and covariant under a joint
    rescale of rewards and temperature (tau is measured in reward units). tau -> 0 gives MaxRL's
    practical estimator on binary rewards only (for scalar rewards it puts all the weight on the group's
    maximum: G/n - 1 on its n maxima, -1 elsewhere); tau -> inf gives Dr.GRPO / tau. Per-rollout expected
    weight is bounded: 0 < c_G(p)/G < e^(1/tau) - 1 for all p and G; the large-group objective is
    the log-MGF ``log E[exp(r / tau)]``.

    Evaluation (docs/objective.md §5.2) is in float64. The rewards are centred on the group maximum *before*
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

    ``temperature_rule="ess"`` (with ``temperature=None``) sets tau per group instead, for scalar rewards:
    the tau at which the softmax weights ``w_j = exp(r_j / tau)`` keep an effective sample size

        ESS(tau) = (sum_j w_j)^2 / (G sum_j w_j^2) = target_ess,    target_ess in (0, 1)

    (see ``ess_temperatures``). ESS is the share of the group the weights effectively keep: 1 is uniform
    weights (tau = inf, every advantage 0), n/G the n members at the group maximum alone (tau -> 0). The
    advantages are then invariant to shifting *and* scaling a group's rewards. The rule is a symmetric
    function of the group, so the exact binary theory of the base class (``population_weight``,
    ``population_objective``) holds for it exactly (binary groups: tau depends on K); the large-group
    log-MGF results (``large_group_weight``, ``large_group_objective``) assume one fixed tau and are refused.
    """

    def __init__(
        self,
        temperature: float | None,
        scale_by_tau: bool = False,
        standardize: bool = False,
        temperature_rule: Literal["fixed", "ess"] = "fixed",
        target_ess: float | None = None,
    ) -> None:
        if temperature_rule not in ("fixed", "ess"):
            raise ValueError(f"temperature_rule must be 'fixed' or 'ess', got {temperature_rule!r}")
        self.temperature_rule = temperature_rule
        self.scale_by_tau = scale_by_tau
        self.standardize = standardize
        if temperature_rule == "ess":
            if temperature is not None:
                raise ValueError(
                    f"temperature must be null with temperature_rule='ess' (the rule sets tau per group), "
                    f"got {temperature!r}"
                )
            if not (_is_real(target_ess) and 0 < target_ess < 1):
                raise ValueError(
                    f"target_ess must be in (0, 1) with temperature_rule='ess' (the share of the group the softmax "
                    f"weights keep; 1 would need tau = inf and give zero advantages; try 0.5), got {target_ess!r}"
                )
            if scale_by_tau or standardize:
                raise ValueError(
                    "scale_by_tau and standardize apply to temperature_rule='fixed' only "
                    "(the ess rule is already invariant to the reward scale): set them false"
                )
            self.temperature, self.target_ess = None, float(target_ess)
            return
        if not (_is_real(temperature) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"temperature must be finite and > 0 (in reward units; try 0.5 for rewards in [0, 1]), "
                f"got {temperature!r}"
            )
        if target_ess is not None:
            raise ValueError(f"target_ess applies to temperature_rule='ess' only; got {target_ess!r} with 'fixed'")
        self.temperature, self.target_ess = float(temperature), None

    def group_temperatures(self, rewards: Tensor) -> Tensor:
        """Each group's tau, float64 ``[B]`` (reward units): the fixed temperature, or the ESS rule's.

        Under the ESS rule a constant group gets tau = 1 (any tau gives it zero advantages).
        """
        r = as_float64(rewards)
        if self.temperature_rule == "fixed":
            return torch.full(r.shape[:1], self.temperature, dtype=torch.float64, device=r.device)
        return ess_temperatures(r, self.target_ess).squeeze(-1)

    def _advantages(self, rewards: Tensor) -> Tensor:
        r = standardized(rewards) if self.standardize else rewards
        g = r.shape[-1]
        tau = self.temperature if self.temperature_rule == "fixed" else ess_temperatures(r, self.target_ess)
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
        """lim_{G->inf} c_G(p)/G = (beta - 1) / (1 + p (beta - 1)), beta = e^(1/tau) (docs/objective.md §4.3).

        Binary rewards; per rollout; times tau with ``scale_by_tau``.
        """
        self._require_canonical("large_group_weight")
        p64 = as_float64(p)
        bm1 = math.expm1(1 / self.temperature)
        weight = bm1 / (1 + p64 * bm1)
        return weight * self.temperature if self.scale_by_tau else weight

    def large_group_objective(self, values: Tensor, probs: Tensor) -> Tensor:
        """log E[exp(r / tau)] for a discrete reward law P(r = values[..., j]) = probs[..., j] (docs/objective.md §4.4).

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
        if self.temperature_rule != "fixed":
            raise ValueError(
                f"{what} is defined for one fixed temperature; temperature_rule={self.temperature_rule!r} sets tau "
                "per group from the data (use population_weight / population_objective, exact for binary rewards)"
            )
        if self.standardize:
            raise ValueError(f"{what} is defined for standardize=False; z-scored rewards have no log-MGF form")


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def ess_fraction(rewards: Tensor, temperature: Tensor | float) -> Tensor:
    """``ESS / G = (sum_j w_j)^2 / (G sum_j w_j^2)`` of the softmax weights ``w_j = exp(r_j / tau)`` per group.

    ``rewards`` ``[B, G]``, ``temperature`` a number or ``[B, 1]``; float64 ``[B, 1]`` in [1/G, 1]. The weights
    are taken relative to the group maximum (``w <= 1``, nothing overflows).
    """
    r = as_float64(rewards)
    w = torch.sub(r, r.amax(-1, keepdim=True)).div_(temperature).exp_()
    return w.sum(-1, keepdim=True).square_().div_(w.square().sum(-1, keepdim=True) * r.shape[-1])


def ess_temperatures(rewards: Tensor, target: float) -> Tensor:
    """Per-group tau with ``ESS(tau) / G = target`` (``ess_fraction``): float64 ``[B, 1]``, reward units.

    With beta = 1/tau and L(beta) = log sum_j exp(beta r_j), log(G ESS) = 2 L(beta) - L(2 beta), whose
    derivative in beta is 2 (E_beta[r] - E_2beta[r]) <= 0 (E_beta[r], the softmax mean, grows with beta):
    ESS is increasing in tau, strictly for a non-constant group, from n/G (tau -> 0; n members tied at the
    maximum) to 1 (tau -> inf). Writing tau = t (max r - min r), ESS depends on t alone (shift and scale
    invariance), and t is found by bisection on log t in [2^-20, 2^20] (64 steps, to float64 precision).
    A target at or below n/G is unreachable: t = 2^-20, where exp(-2^20) == 0 gives the tau -> 0 advantages
    (G/n - 1 on the n maxima, -1 elsewhere; MaxRL's when the rewards are binary). A constant group gets
    tau = 1 (its advantages are 0 at any tau). Example: rewards (0, 1), target 0.9 -> e^(1/tau) = 2,
    tau = 1/ln 2 = 1.4427.
    """
    r = as_float64(rewards)
    spread = r.amax(-1, keepdim=True) - r.amin(-1, keepdim=True)  # [B, 1]
    constant = spread == 0
    x = torch.where(constant, 0.0, (r - r.amax(-1, keepdim=True)) / torch.where(constant, 1.0, spread))  # [-1, 0]
    lo = torch.full_like(spread, -_ESS_LOG_RANGE)
    hi = torch.full_like(spread, _ESS_LOG_RANGE)
    for _ in range(_ESS_STEPS):
        mid = (lo + hi) / 2
        low_ess = ess_fraction(x, mid.exp()) < target  # too peaked: raise tau
        lo, hi = torch.where(low_ess, mid, lo), torch.where(low_ess, hi, mid)
    t = torch.where(hi >= _ESS_LOG_RANGE, hi, torch.where(lo <= -_ESS_LOG_RANGE, lo, (lo + hi) / 2)).exp()
    return torch.where(constant, 1.0, t * spread)


def log_mgf(rewards: Tensor, temperature: Tensor | float) -> Tensor:
    """Per group, a plug-in estimate of the log-MGF objective (docs/objective.md §4.4), float64 ``[B]``:

        J_tau(r) = tau log( (1/G) sum_j exp(r_j / tau) ),

    the empirical log-moment-generating function of the group's rewards at 1/tau, in reward units: a soft
    maximum between mean(r) (tau -> inf) and max(r) (tau -> 0). It estimates, from this one group,
    tau log E[exp(r / tau)]: tau times the log-MGF objective whose gradient SoftmaxGRPO's expected update per
    rollout tends to as G grows (``SoftmaxGRPO.large_group_objective``). It is not that objective itself (its
    expectation is at most it, by Jensen), and at finite G the update need not ascend any objective (§3.4).
    Evaluated stably as ``m + tau (logsumexp((r - m) / tau) - log G)`` with m = max r, so large rewards and
    small tau neither overflow nor lose the differences. ``temperature``: a number or ``[B]`` / ``[B, 1]``.
    Example: rewards (0, 1), tau = 1 -> log((1 + e)/2) = 0.62011.
    """
    r = as_float64(rewards)
    tau = as_float64(temperature).to(r.device)
    tau = tau.reshape(-1, 1) if tau.dim() else tau
    m = r.amax(-1, keepdim=True)
    centred = torch.logsumexp(torch.sub(r, m).div_(tau), dim=-1, keepdim=True) - math.log(r.shape[-1])
    return (m + tau * centred).squeeze(-1)
