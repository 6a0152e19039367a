"""A run whose reward keeps failing stops: ``RewardFailureWatch`` counts failed scorings over processes."""

from __future__ import annotations

import torch


class RewardFailureError(RuntimeError):
    """A run stopped because its reward kept failing; the message says how often and what to change."""


class RewardFailureWatch:
    """Stops a run when at least ``share`` of a step's rewards failed for ``steps`` steps in a row.

    A failed scoring (it raised, timed out, or was not finite) scores as a wrong answer: a reward that
    always fails gives every completion the same score, so the run trains nothing while looking
    healthy. Counts are summed over processes, so every process stops at the same step.
    """

    def __init__(self, share: float = 1.0, steps: int = 3) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"reward_failure_share must be in (0, 1] (1: all of a step's rewards), got {share}")
        if steps < 1:
            raise ValueError(f"reward_failure_steps must be >= 1, got {steps}")
        self.share, self.steps = share, steps
        self.streak = 0  # consecutive steps over the share

    def observe(self, failures: float, total: int, strategy) -> None:
        """Count one step's ``failures`` of ``total`` rewards (this process's); raise on the ``steps``-th bad step."""
        counts = torch.tensor([float(failures), float(total)], device=strategy.root_device)
        failed, scored = strategy.reduce(counts, reduce_op="sum").tolist()
        self.streak = self.streak + 1 if scored and failed >= self.share * scored else 0
        if self.streak >= self.steps:
            raise RewardFailureError(
                f"the reward failed for {failed:.0f} of {scored:.0f} completions, and for at least {self.share:.0%} "
                f"of them {self.steps} steps in a row: a failed scoring counts as a wrong answer, so this run "
                f"trains nothing; the first failure's error is in the log above (fix the reward, or raise "
                f"model.reward_failure_share / model.reward_failure_steps)"
            )
