"""Evaluation maths: unbiased pass@k and accuracy by difficulty (pure functions of tensors)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor


def pass_at_k(num_correct: Tensor, num_samples: int, k: int) -> Tensor:
    """Unbiased pass@k per prompt: ``1 - C(n - c, k) / C(n, k)`` (Chen et al., arXiv 2107.03374).

    ``num_correct`` ``[B]`` counts of correct samples out of ``num_samples`` = n >= k. Evaluated as
    ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` for stability.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, n={num_samples}], got {k}")
    c = num_correct.to(torch.float64)
    i = torch.arange(1, num_samples + 1, dtype=torch.float64, device=c.device)  # [n]
    factors = torch.where(i > num_samples - c.unsqueeze(-1), 1 - k / i, torch.ones_like(i))  # [B, n]
    return 1 - factors.prod(-1)


def accuracy_by_difficulty(correct: Tensor, difficulties: Sequence[object]) -> dict[str, float]:
    """Mean of ``correct`` ``[B, n]`` (per prompt, over samples) grouped by each prompt's difficulty."""
    per_prompt = correct.float().mean(-1)
    groups = rows_by_difficulty(difficulties, len(per_prompt))
    return {level: per_prompt[rows].mean().item() for level, rows in groups.items()}


def rows_by_difficulty(difficulties: Sequence[object], prompts: int) -> dict[str, list[int]]:
    """The indices of each difficulty (as a string) among ``prompts`` rows, one difficulty per row: levels in
    numeric order, then the others by name."""
    if len(difficulties) != prompts:
        raise ValueError(f"{len(difficulties)} difficulties for {prompts} prompts")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, level in enumerate(difficulties):
        groups[str(level)].append(i)
    return dict(sorted(groups.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(level: str) -> tuple[int, float | str]:
    try:
        return (0, float(level))
    except ValueError:
        return (1, level)


def pass_at_k_by_difficulty(correct: Tensor, difficulties: Sequence[object]) -> dict[str, dict[int, float]]:
    """Unbiased pass@k for k = 1..n, averaged over the prompts of each difficulty: ``{level: {k: value}}``.

    ``correct`` ``[B, n]``; per prompt ``1 - C(n - c, k) / C(n, k)`` with c its correct samples
    (``pass_at_k``), then the mean over the prompts of the level.
    """
    n, counts = correct.shape[-1], correct.sum(-1)
    return {
        level: {k: pass_at_k(counts[rows], n, k).mean().item() for k in range(1, n + 1)}
        for level, rows in rows_by_difficulty(difficulties, len(counts)).items()
    }


def success_count_histogram(correct: Tensor) -> list[float]:
    """Share of prompts with c correct samples out of n, for c = 0..n: ``h[c] = #{b : sum_i correct[b, i] = c} / B``.

    With n equal to the training group size G this is a sample of the law of the number of successes K
    in a training group drawn from the same prompts and policy (docs/gradient_budget.md §6, expected shares).
    """
    n = correct.shape[-1]
    counts = torch.bincount(correct.sum(-1).long().flatten(), minlength=n + 1).to(torch.float64)
    return (counts / counts.sum().clamp_min(1)).tolist()
