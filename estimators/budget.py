"""Where the gradient budget goes: advantage mass by prompt difficulty (docs/gradient_budget.md §6)."""

from __future__ import annotations

import torch
from torch import Tensor

#: difficulty buckets by group success rate K/G; "unsolved" (0) and "solved" (1) carry zero mass for
#: every estimator that zeroes constant groups, and are kept so the shares always sum to 1.
BUCKETS: tuple[str, ...] = ("unsolved", "hard", "mid_hard", "half", "mid_easy", "near_solved", "solved")
_TOL = 1e-9


def difficulty_bucket(success_rate: Tensor) -> Tensor:
    """Bucket index into ``BUCKETS`` for each rate: 0 {0}, hard (0, 1/4], mid-hard (1/4, 1/2),
    half {1/2}, mid-easy (1/2, 3/4), near-solved [3/4, 1), solved {1}."""
    s = success_rate.to(torch.float64)
    idx = torch.full(s.shape, 5, dtype=torch.long, device=s.device)
    idx = torch.where(s < 0.75 - _TOL, 4, idx)
    idx = torch.where(s <= 0.5 + _TOL, 3, idx)
    idx = torch.where(s < 0.5 - _TOL, 2, idx)
    idx = torch.where(s <= 0.25 + _TOL, 1, idx)
    idx = torch.where(s <= _TOL, 0, idx)
    return torch.where(s >= 1 - _TOL, 6, idx)


def budget_mass(advantages: Tensor, group_success_rate: Tensor) -> Tensor:
    """Advantage mass per bucket: ``[2, len(BUCKETS)]``, row 0 sum |A_i|, row 1 sum A_i^2.

    Masses add across batches and processes, so sum (all-reduce) them before ``budget_shares``.
    """
    if advantages.dim() != 2 or group_success_rate.shape != advantages.shape[:1]:
        raise ValueError(
            f"expected advantages [B, G] and group_success_rate [B], got {tuple(advantages.shape)} "
            f"and {tuple(group_success_rate.shape)}"
        )
    a = advantages.detach().to(torch.float64)
    per_group = torch.stack([a.abs().sum(-1), a.square().sum(-1)])  # [2, B]
    idx = difficulty_bucket(group_success_rate.detach()).to(a.device)
    mass = torch.zeros(2, len(BUCKETS), dtype=torch.float64, device=a.device)
    return mass.index_add_(1, idx, per_group)


def budget_shares(mass: Tensor) -> dict[str, Tensor]:
    """Normalise ``budget_mass`` to shares keyed ``l1/<bucket>`` and ``l2/<bucket>`` (0 if no mass)."""
    shares = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    return {f"{norm}/{name}": shares[i, j] for i, norm in enumerate(("l1", "l2")) for j, name in enumerate(BUCKETS)}


def gradient_budget(advantages: Tensor, group_success_rate: Tensor) -> dict[str, Tensor]:
    """Share of the L1 (sum |A_i|) and L2 (sum A_i^2) advantage mass per difficulty bucket.

    ``advantages`` ``[B, G]``; ``group_success_rate`` ``[B]`` (K/G for binary rewards, or the group's
    success rate under the task's success test). B2 is a proxy for ||sum_i A_i s_i||^2 when the
    rollouts' score vectors are roughly orthogonal with equal norms (docs/gradient_budget.md §6; SoftmaxGRPO arXiv
    2608.09271 reports the budget moving away from near-solved prompts).
    """
    return budget_shares(budget_mass(advantages, group_success_rate))
