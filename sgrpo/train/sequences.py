"""What one *sequence* is to the loss's aggregation when a multi-turn trajectory spans several rows.

A trajectory (``RolloutBatch.trajectory``: an episode whose chat template stopped extending its tokens continued in
a new row) is one sample of the policy: its rows share one advantage, so the aggregations that average per sequence
count it once (docs/environments.md, "Trajectories in the loss"):

* ``seq_mean_token_mean`` weighs a token 1 / (B |o_i|), B the trajectories in the mini-batch and |o_i| the loss
  tokens of the token's trajectory over all its rows (``sequence_tokens``); before, each row was a sequence of its
  own, so a forked trajectory counted 2 or more times and its tokens weighed more per token in its shorter rows;
* ``seq_sum_const`` (Dr.GRPO) weighs a token 1 / (B L), L the most tokens a trajectory can generate
  (``sequence_budget``): ``max_new_tokens`` for one completion, ``max_turns`` x ``max_new_tokens`` for an episode
  (at most the environment's ``max_episode_tokens``), where it was one turn's ``max_new_tokens``;
* a trajectory's rows stay in one mini-batch (``minibatch_rows``), so one optimiser step sees all of it.

Single-turn (``trajectory`` None) every function gives what the row-based code gave: the same mini-batches (the same
shuffle), counts and weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sgrpo.train.correction import log_ratios, sequence_sums


def minibatch_rows(rows: Tensor, trajectory: Tensor | None, order: Tensor | None, parts: int) -> list[Tensor]:
    """``rows`` (ascending row indices) cut into ``parts`` mini-batches, each trajectory's rows in one.

    ``order`` permutes the trajectories among ``rows`` (``trajectory_count`` of them; None: as they are), then
    they are cut as ``Tensor.tensor_split`` cuts (the first ``n % parts`` parts one longer). Single-turn this is
    ``rows[order].tensor_split(parts)``.
    """
    if trajectory is None:
        ordered = rows if order is None else rows[order.to(rows.device)]
        return list(ordered.tensor_split(parts))
    groups = _trajectory_rows(rows, trajectory)
    if order is not None:
        groups = [groups[j] for j in order.tolist()]
    cut = torch.arange(len(groups), device="cpu").tensor_split(parts)
    return [torch.cat([groups[j] for j in part.tolist()]) if len(part) else rows[:0] for part in cut]


def trajectory_count(rows: Tensor, trajectory: Tensor | None) -> int:
    """How many trajectories ``rows`` hold (``len(rows)`` single-turn)."""
    if trajectory is None:
        return len(rows)
    return int(torch.unique(trajectory.to(rows.device)[rows]).numel())


def sequence_tokens(token_mask: Tensor, rows: Tensor, trajectory: Tensor | None) -> Tensor | None:
    """``[N]`` float: for each of ``rows``, the loss tokens of its trajectory over all its rows in ``rows`` (0
    elsewhere); None single-turn (a row's own count, which ``token_weights`` takes itself)."""
    if trajectory is None:
        return None
    return _trajectory_totals(token_mask[rows].sum(-1).float(), rows, trajectory, token_mask.shape[0])


def trajectory_sums(proximal: Tensor, behaviour: Tensor, token_mask: Tensor, rows: Tensor,
                    trajectory: Tensor | None) -> Tensor | None:  # fmt: skip
    """``[N, 3]`` float: for each of ``rows``, ``sgrpo.train.correction.sequence_sums`` of its trajectory over all
    its rows in ``rows`` (sum of delta = log pi_prox - log mu, sum of k3, loss tokens; 0 elsewhere), what a
    ``SequenceCorrection`` rejects a trajectory by; None single-turn (each row's own, which it takes itself)."""
    if trajectory is None:
        return None
    mask = token_mask[rows]
    per_row = sequence_sums(log_ratios(proximal[rows], behaviour[rows], mask), mask)  # [R, 3]
    return _trajectory_totals(per_row, rows, trajectory, token_mask.shape[0])


def _trajectory_totals(per_row: Tensor, rows: Tensor, trajectory: Tensor, n: int) -> Tensor:
    """``per_row`` ``[R, ...]`` (one entry per row of ``rows``) added up per trajectory, each row given its
    trajectory's total: ``[n, ...]``, 0 at the rows not in ``rows``."""
    own = trajectory.to(rows.device)[rows]  # [R]
    size = int(trajectory.max()) + 1 if trajectory.numel() else 0  # a process the exchange left without rows: none
    totals = per_row.new_zeros((size, *per_row.shape[1:]))
    totals.index_add_(0, own, per_row)
    out = per_row.new_zeros((n, *per_row.shape[1:]))
    out[rows] = totals[own]
    return out


def sequence_budget(max_new_tokens: int, environment=None, episodes: bool = False) -> int:
    """L of ``seq_sum_const``: the most tokens one trajectory can generate. One completion: ``max_new_tokens``; an
    episode (``episodes``): ``environment.max_turns`` x ``max_new_tokens``, at most its ``max_episode_tokens``
    (generated and observation tokens after the opening: a bound on the generated ones)."""
    if not episodes or environment is None:
        return max_new_tokens
    budget = int(environment.max_turns) * max_new_tokens
    limit = getattr(environment, "max_episode_tokens", None)
    return budget if limit is None else max(1, min(budget, int(limit)))


def _trajectory_rows(rows: Tensor, trajectory: Tensor) -> list[Tensor]:
    """``rows`` grouped by trajectory, in order (a trajectory's rows are consecutive: ``RolloutBatch``)."""
    own = trajectory.to(rows.device)[rows]
    _, counts = torch.unique_consecutive(own, return_counts=True)
    return list(rows.split(counts.tolist()))
