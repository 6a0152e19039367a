"""The advantage-estimator interface and the exact finite-group theory every estimator inherits.

An estimator maps a group of rewards to advantages, ``[B, G] -> [B, G]``. Subclasses implement
``_advantages`` on validated float64 full groups; the base class owns input checks, dropped members
(masks), dtype handling, and the exact population theory of docs/objective.md §3, which it
derives from ``__call__`` alone so that a user's new estimator gets it for free.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor


class AdvantageEstimator(ABC):
    """Base class: group rewards ``[B, G]`` -> advantages ``[B, G]``, plus exact binary-reward theory.

    For a *symmetric* estimator (advantages equivariant under permutations of the group) and binary
    rewards with pass rate p, the expected update of one group is ``E[sum_i A_i s_i] = c_G(p) grad p``
    with (docs/objective.md §3.1, SoftmaxGRPO arXiv 2608.09271)

        c_G(p) = G * sum_{k=0}^{G-1} C(G-1, k) p^k (1-p)^(G-1-k) * Delta(k),
        Delta(k) = a_+(k+1) - a_-(k),

    where a_+(K) / a_-(K) are the advantages of a success / failure in a group with K successes.
    The exact finite-group objective is ``F_G(p) = E_{K~Bin(G,p)} Phi(K)`` with
    ``Phi(K) = sum_{k<K} Delta(k)`` (§4.2), so ``F_G' = c_G`` and ``F_G(0) = 0``.
    Both are computed by evaluating the estimator on the G+1 binary groups.
    """

    #: rewards must be >= 0 (e.g. MaxRL divides by the group mean)
    requires_nonnegative_rewards: bool = False

    # ------------------------------------------------------------------ advantages
    def __call__(self, rewards: Tensor, mask: Tensor | None = None) -> Tensor:
        """Advantages for ``rewards`` ``[B, G]``; ``mask`` ``[B, G]`` (bool) marks valid members.

        Computed in float64 and returned in the input's floating dtype. With a mask, each group
        is evaluated over its valid members only (G = their count); groups with fewer than two
        valid members, and the masked-out members themselves, get advantage 0 (docs/theory.md §2.1).
        """
        _check_rewards(rewards, mask)
        out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
        r = rewards.to(torch.float64)
        full = mask is None or (r.shape[-1] >= 2 and bool(mask.all()))
        _check_finite(r, None if full else mask)
        if self.requires_nonnegative_rewards and r.numel() > 0:
            smallest = r.amin() if full else torch.where(mask, r, 0.0).amin()
            if bool(smallest < 0):
                raise ValueError(
                    f"{type(self).__name__} needs rewards >= 0 (it divides by the group mean); got a "
                    f"minimum of {smallest.item():g}. Use a {{0, 1}} reward scale, not ±1."
                )
        adv = self._advantages(r) if full else _masked(self._advantages, r, mask)
        return adv.to(out_dtype)

    @abstractmethod
    def _advantages(self, rewards: Tensor) -> Tensor:
        """float64 ``[B, G]`` with G >= 2, finite, all members valid -> float64 ``[B, G]``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"

    # ------------------------------------------------------------------ exact binary theory
    def binary_group_advantages(self, group_size: int) -> Tensor:
        """Advantages of the G+1 binary groups: row K holds K successes then G-K failures.

        Returns float64 ``[G+1, G]``; ``a_+(K) = out[K, 0]`` (K >= 1), ``a_-(K) = out[K, G-1]`` (K < G).
        """
        g = _check_group_size(group_size)
        k = torch.arange(g + 1, device="cpu").unsqueeze(1)  # [G+1, 1]: a small host table
        rewards = (torch.arange(g, device="cpu").unsqueeze(0) < k).to(torch.float64)  # [G+1, G]
        return self(rewards)

    def binary_deltas(self, group_size: int) -> Tensor:
        """``Delta(k) = a_+(k+1) - a_-(k)`` for k = 0..G-1, float64 ``[G]``."""
        table = self.binary_group_advantages(group_size)  # [G+1, G]
        return table[1:, 0] - table[:-1, -1]

    def population_weight(self, p: Tensor | float, group_size: int) -> Tensor:
        """Exact c_G(p): the multiplier of grad p in the expected update of one group (docs/objective.md §3.1)."""
        g = _check_group_size(group_size)
        p64 = _check_probability(p)
        delta = self.binary_deltas(g).to(p64.device)  # [G]
        return g * (binomial_pmf(p64, g - 1) * delta).sum(-1)

    def population_objective(self, p: Tensor | float, group_size: int) -> Tensor:
        """Exact F_G(p) = E_{K~Bin(G,p)} Phi(K), Phi(K) = sum_{k<K} Delta(k) (docs/objective.md §3.2); F_G(0) = 0."""
        g = _check_group_size(group_size)
        p64 = _check_probability(p)
        deltas = self.binary_deltas(g).to(p64.device)  # [G]
        phi = torch.cat([deltas.new_zeros(1), deltas.cumsum(0)])  # [G+1]
        return (binomial_pmf(p64, g) * phi).sum(-1)


def binomial_pmf(p: Tensor, n: int) -> Tensor:
    """P(K = k) for K ~ Bin(n, p), k = 0..n: ``p.shape + [n+1]``, float64, exact at p in {0, 1}."""
    k = torch.arange(n + 1, dtype=torch.float64, device=p.device)
    log_comb = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    p = p.unsqueeze(-1)
    return torch.exp(log_comb + torch.xlogy(k, p) + torch.xlogy(n - k, 1 - p))


def first_member_offsets(rewards: Tensor) -> Tensor:
    """``r - r[:, :1]``: shift-invariant estimators work on these differences.

    ``x - y == 0`` exactly iff ``x == y``, so a constant group becomes exact zeros (and its mean,
    sum and norm are exact zeros too) without a separate min/max pass; differences of nearby large
    rewards are exact (Sterbenz), which also helps precision at large offsets.
    """
    return rewards - rewards[:, :1]


def constant_groups(rewards: Tensor) -> Tensor:
    """``[B, 1]`` bool: groups whose rewards are all equal (these get exactly zero advantage)."""
    return rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True)


def standardized(rewards: Tensor) -> Tensor:
    """Per-group z-scores ``(r - mean) / std`` (sample std, floored at 1e-300), float64 ``[B, G]``."""
    centred = rewards - rewards.mean(-1, keepdim=True)
    std = torch.linalg.vector_norm(centred, dim=-1, keepdim=True) / math.sqrt(rewards.shape[-1] - 1)
    return centred.div_(std.clamp_min_(1e-300))


def _check_rewards(rewards: Tensor, mask: Tensor | None) -> None:
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape [B, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be 2-D [B, G] (prompts x group members), got shape {tuple(rewards.shape)}; "
            "reshape with rewards.view(B, G)"
        )
    if mask is None:
        if rewards.shape[1] < 2:
            raise ValueError(f"group size G must be >= 2 to compare rollouts, got G={rewards.shape[1]}")
        return
    if mask.shape != rewards.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor with the rewards' shape {tuple(rewards.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )


def _check_finite(rewards: Tensor, mask: Tensor | None) -> None:
    """Raise on NaN or inf among the (valid) rewards; one reduction when all are finite."""
    if mask is None and math.isfinite(rewards.sum().item()):
        return  # a NaN or inf anywhere makes the sum non-finite (the converse may be overflow)
    finite = torch.isfinite(rewards) if mask is None else torch.isfinite(rewards) | ~mask
    if not bool(finite.all()):
        bad = rewards[~finite][:3].tolist()
        raise ValueError(
            f"rewards must be finite, found {bad} (first non-finite values); "
            "score failed or timed-out rollouts 0, or drop them with a mask"
        )


def _check_group_size(group_size: int) -> int:
    if int(group_size) != group_size or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2, got {group_size!r}")
    return int(group_size)


def as_float64(x: Tensor | float | list) -> Tensor:
    """``x`` as a float64 tensor: a tensor keeps its device, Python numbers become host tensors."""
    return torch.as_tensor(x, dtype=torch.float64, device=x.device if isinstance(x, Tensor) else "cpu")


def _check_probability(p: Tensor | float) -> Tensor:
    p64 = as_float64(p)
    if not bool(((p64 >= 0) & (p64 <= 1)).all()):
        raise ValueError(f"p must be a pass rate in [0, 1], got {p64.tolist()}")
    return p64


def _masked(fn, rewards: Tensor, mask: Tensor) -> Tensor:
    """Evaluate ``fn`` group by group on valid members only, batching groups of equal valid count."""
    out = torch.zeros_like(rewards)
    counts = mask.sum(-1)  # [B]
    # stable sort puts each row's valid members first, in their original order
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices  # [B, G]
    for n in counts.unique().tolist():
        if n < 2:
            continue
        rows = (counts == n).nonzero().squeeze(-1)
        cols = order[rows, :n]  # [b, n]
        out[rows.unsqueeze(-1), cols] = fn(rewards[rows.unsqueeze(-1), cols])
    return out
