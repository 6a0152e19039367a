"""The evaluation's torchmetrics ``Metric`` s, one set of them per evaluation set.

Each metric holds one row per evaluated prompt, ``(index, solved, level)``: the prompt's index in its evaluation
set, its correct samples out of n, and its difficulty as an index into the set's known labels (``levels``:
difficulty labels may be strings, which torchmetrics' tensor states cannot hold). torchmetrics concatenates the
rows of every process when the metric is computed (``dist_reduce_fx="cat"``, over processes holding different
numbers of prompts, or none), and ``compute`` counts each prompt once: Lightning's ``DistributedSampler`` repeats
a few prompts so that every process gets as many, and the first copy (the lowest rank's) stands for the prompt.
The maths is ``sgrpo.eval.passk``' (float64 unbiased pass@k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from sgrpo.eval.passk import pass_at_k


class PromptOutcomes(Metric):
    """Per prompt of one evaluation set: (index, correct samples of ``samples``, difficulty index in ``levels``).

    ``update(index [B], correct [B, n] bool, level [B])``; ``outcomes()`` gives ``(solved [P], level [P])`` of
    the P distinct prompts seen by all processes. Subclasses compute one quantity from them.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, samples: int, levels: Sequence[str] = ("",), **kwargs) -> None:
        super().__init__(**kwargs)
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.samples, self.levels = samples, [str(level) for level in levels]
        self.add_state("rows", default=[], dist_reduce_fx="cat")  # [P, 3] long: index, solved, level

    def update(self, index: Tensor, correct: Tensor, level: Tensor) -> None:
        if correct.dim() != 2 or correct.shape[1] != self.samples or not len(index) == len(level) == len(correct):
            raise ValueError(
                f"expected index [B], correct [B, {self.samples}] and level [B], got {tuple(index.shape)}, "
                f"{tuple(correct.shape)} and {tuple(level.shape)}"
            )
        if len(level) and not 0 <= int(level.min()) <= int(level.max()) < len(self.levels):
            raise ValueError(f"level indices must be in [0, {len(self.levels)}), got {level.tolist()}")
        solved = correct.to(self.device).sum(-1)
        self.rows.append(torch.stack([index.to(self.device), solved, level.to(self.device)], -1).long())

    def _sync_dist(self, dist_sync_fn=gather_all_tensors, process_group=None) -> None:
        # a process that holds no prompt of this set gathers an empty [0, 3] long block, not torchmetrics'
        # stand-in (a 1-d float tensor, whose shape and dtype the other processes' rows would not match)
        if isinstance(self.rows, list) and not self.rows:
            self.rows.append(torch.zeros(0, 3, dtype=torch.long, device=self.device))
        super()._sync_dist(dist_sync_fn, process_group)

    def outcomes(self) -> tuple[Tensor, Tensor]:
        """``(solved, level)`` of each distinct prompt index, from its first row (rows are in rank order)."""
        empty = isinstance(self.rows, list) and not self.rows  # a list before syncing, one tensor after
        rows = torch.zeros(0, 3, dtype=torch.long, device=self.device) if empty else dim_zero_cat(self.rows)
        rows = rows.view(-1, 3)
        order = torch.argsort(rows[:, 0], stable=True)
        rows = rows[order]
        first = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        first[1:] = rows[1:, 0] != rows[:-1, 0]
        return rows[first, 1], rows[first, 2]


class PassAtK(PromptOutcomes):
    """Unbiased pass@k for k = 1..n, the mean over prompts of ``1 - C(n - c, k) / C(n, k)`` (c: the prompt's
    correct samples; ``sgrpo.eval.passk.pass_at_k``, float64): ``[n]``, entry k-1 for pass@k."""

    def compute(self) -> Tensor:
        solved, _ = self.outcomes()
        ks = range(1, self.samples + 1)
        return torch.stack([pass_at_k(solved, self.samples, k).mean() for k in ks])


class MeanAccuracy(PromptOutcomes):
    """Mean success over every sample of every prompt: ``sum_b c_b / (P n)`` (float64 scalar; pass@1)."""

    def compute(self) -> Tensor:
        solved, _ = self.outcomes()
        return solved.to(torch.float64).sum() / (len(solved) * self.samples)


class AccuracyByDifficulty(PromptOutcomes):
    """Mean success per difficulty label: ``[len(levels)]`` float64, NaN for a label without prompts."""

    def compute(self) -> Tensor:
        solved, level = self.outcomes()
        count = torch.bincount(level, minlength=len(self.levels)).to(torch.float64)
        # index_add_, not a weighted bincount: CUDA has no deterministic one (trainer.deterministic raised)
        total = torch.zeros(len(self.levels), dtype=torch.float64, device=level.device)
        total.index_add_(0, level, solved.to(torch.float64))
        return total / (count * self.samples)  # 0 / 0 = NaN where a label has no prompt


class PassAtKByDifficulty(PromptOutcomes):
    """Unbiased pass@k for k = 1..n averaged over the prompts of each difficulty label: ``[len(levels), n]``
    float64, NaN rows for labels without prompts."""

    def compute(self) -> Tensor:
        solved, level = self.outcomes()
        per_prompt = torch.stack([pass_at_k(solved, self.samples, k) for k in range(1, self.samples + 1)], -1)
        count = torch.bincount(level, minlength=len(self.levels)).to(torch.float64)  # [L]
        sums = torch.zeros(len(self.levels), self.samples, dtype=torch.float64, device=solved.device)
        sums.index_add_(0, level, per_prompt)
        return sums / count.unsqueeze(-1)


class SuccessCounts(PromptOutcomes):
    """Prompts with c correct samples of n, for c = 0..n: ``[n + 1]`` float64 counts (their sum: the prompts;
    the shares are ``sgrpo.eval.passk.success_count_histogram``'s)."""

    def compute(self) -> Tensor:
        solved, _ = self.outcomes()
        return torch.bincount(solved, minlength=self.samples + 1).to(torch.float64)


#: the metrics of one evaluation set, by the name its result takes
SET_METRICS = {
    "accuracy": MeanAccuracy,
    "pass_at_k": PassAtK,
    "by_difficulty": AccuracyByDifficulty,
    "pass_at_k_by_difficulty": PassAtKByDifficulty,
    "successes": SuccessCounts,
}


class MeanReward(Metric):
    """The mean training reward over every sample of every distinct prompt: ``sum_b r_b / (P n)`` (float64
    scalar), r_b the prompt's summed reward over its n samples (verl's validation score: OpenThoughts has no
    verifier). ``update(index [B], rewards [B, n] float)``; a prompt repeated across processes counts once."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, samples: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.samples = samples
        self.add_state("rows", default=[], dist_reduce_fx="cat")  # [P, 2] float64: index, summed reward

    def update(self, index: Tensor, rewards: Tensor) -> None:
        if rewards.dim() != 2 or rewards.shape[1] != self.samples or len(index) != len(rewards):
            raise ValueError(f"expected index [B] and rewards [B, {self.samples}], got {tuple(index.shape)}, "
                             f"{tuple(rewards.shape)}")  # fmt: skip
        summed = rewards.to(self.device, torch.float64).sum(-1)
        self.rows.append(torch.stack([index.to(self.device, torch.float64), summed], -1))

    def _sync_dist(self, dist_sync_fn=gather_all_tensors, process_group=None) -> None:
        if isinstance(self.rows, list) and not self.rows:  # as PromptOutcomes: an empty [0, 2] block
            self.rows.append(torch.zeros(0, 2, dtype=torch.float64, device=self.device))
        super()._sync_dist(dist_sync_fn, process_group)

    def compute(self) -> Tensor:
        empty = isinstance(self.rows, list) and not self.rows
        rows = torch.zeros(0, 2, dtype=torch.float64, device=self.device) if empty else dim_zero_cat(self.rows)
        rows = rows.view(-1, 2)
        rows = rows[torch.argsort(rows[:, 0], stable=True)]
        first = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        first[1:] = rows[1:, 0] != rows[:-1, 0]
        return rows[first, 1].sum() / (int(first.sum()) * self.samples)


#: the per-episode quantities logged as ``train/episode/*`` and ``val/episode/*`` (``episode_values``)
EPISODE_METRICS = ("turns", "tool_calls", "tool_failures", "forks", "tokens/generated", "tokens/observation",
                   "tool_use_rate", "env_reward")  # fmt: skip


def episode_values(episodes) -> dict[str, list[float]]:
    """Each ``EPISODE_METRICS`` quantity of each episode (``sgrpo.types.Episode``): its turns, tool calls, tool
    failures, forks (rows started where the chat template broke the prefix), tokens after the opening by role,
    ``tool_use_rate`` (1 if it called a tool, else 0) and ``env_reward`` (its per-turn rewards summed)."""
    fields = {"turns": "turns", "tool_calls": "tool_calls", "tool_failures": "tool_failures", "forks": "forks",
              "tokens/generated": "generated_tokens", "tokens/observation": "observation_tokens"}  # fmt: skip
    values = {name: [float(getattr(e, key)) for e in episodes] for name, key in fields.items()}
    values["tool_use_rate"] = [float(e.tool_calls > 0) for e in episodes]
    values["env_reward"] = [float(e.reward) for e in episodes]
    return values
