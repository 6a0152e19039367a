"""The maths of ``benchmarks/head_to_head_tail.py`` (split from it; the report and the run stay there): Student-t
quantiles and the seeds a half-width needs, expected budget shares from an estimator's binary advantages, the
trapezoid over steps, the primary metric and the hard levels' pass@k."""

from __future__ import annotations

import math

import torch

from estimators import BUCKETS, difficulty_bucket
from estimators.base import binomial_pmf


def t_quantile(df: int, level: float = 0.95) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + level / 2, df))


def seeds_needed(sd: float, half_width: float, level: float = 0.95) -> int | None:
    """Smallest n >= 2 with ``t(0.5 + level/2, n - 1) * sd / sqrt(n) <= half_width`` (None past 10,000)."""
    if sd == 0:
        return 2
    for n in range(2, 10_001):
        if t_quantile(n - 1, level) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def group_l1_mass(estimator, group_size: int) -> torch.Tensor:
    """``B1(K) = sum_i |A_i|`` of the binary group with K successes, K = 0..G: float64 ``[G+1]``."""
    return estimator.binary_group_advantages(group_size).abs().sum(-1)


def expected_shares(estimator, group_size: int, k_law: torch.Tensor) -> dict[str, float]:
    """Expected L1 budget shares when a group's success count K has law ``k_law`` ``[G+1]``:
    ``share_b = sum_K P(K) B1(K) [K/G in b] / sum_K P(K) B1(K)`` (docs/gradient_budget.md §6)."""
    mass = k_law.to(torch.float64) * group_l1_mass(estimator, group_size)  # [G+1]
    buckets = difficulty_bucket(torch.arange(group_size + 1, dtype=torch.float64) / group_size)
    per_bucket = torch.zeros(len(BUCKETS), dtype=torch.float64).index_add_(0, buckets, mass)
    per_bucket = per_bucket / per_bucket.sum().clamp_min(torch.finfo(torch.float64).tiny)
    return dict(zip(BUCKETS, per_bucket.tolist(), strict=True))


def binomial_law(rates: list[float], group_size: int) -> torch.Tensor:
    """Law of K for a group of a prompt drawn uniformly from prompts of pass rates ``rates``:
    ``P(K) = mean_l Bin(K; G, p_l)``, ``[G+1]``."""
    return binomial_pmf(torch.tensor(rates, dtype=torch.float64), group_size).mean(0)


def hard_weight_share(estimator, group_size: int, rates: dict[str, float], hard: list[str]) -> float:
    """``sum_{l in hard} c_G(p_l) / sum_l c_G(p_l)``: the hard levels' share of the expected update weight
    (``population_weight``, docs/objective.md §3.1) at per-level pass rates ``rates``."""
    weights = {lv: float(estimator.population_weight(p, group_size)) for lv, p in rates.items()}
    total = sum(weights.values())
    return sum(weights[lv] for lv in hard if lv in weights) / total if total > 0 else math.nan


def trapezoid(values: list[dict[str, float]]) -> dict[str, float]:
    """Average over equally spaced validations with the end points at half weight (one: itself)."""
    if len(values) == 1:
        return values[0]
    w = [0.5] + [1.0] * (len(values) - 2) + [0.5]
    return {k: sum(wi * v[k] for wi, v in zip(w, values, strict=True)) / sum(w) for k in values[0]}


def primary(result: dict, levels: list[str]) -> float:
    """The primary metric of one run: final accuracy averaged over ``levels``."""
    return sum(result["final"]["by_difficulty"][lv] for lv in levels) / len(levels)


def hard_pass(result: dict, levels: list[str], k: str) -> float:
    return sum(result["final"]["pass_at_k_by_difficulty"][lv][k] for lv in levels) / len(levels)
