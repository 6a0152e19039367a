"""Runs that stop rather than train on wrongly: ``RewardFailureWatch`` counts failed scorings over processes,
``DivergenceWatch`` skipped optimiser steps whose loss or gradient was not finite. Each raises a ``GuardError``
on every process at the same step (their counts are reduced over processes)."""

from __future__ import annotations

import torch


class GuardError(RuntimeError):
    """A run stopped by a guard, on every process at once; the message is one line saying why and what to do."""


class RewardFailureError(GuardError):
    """A run stopped because its reward kept failing; the message says how often and what to change."""


class EnvironmentFailure(RuntimeError):
    """A step stopped because its multi-turn environment raised; the message names the environment and the error.

    Raised by the one process whose episode failed (not a ``GuardError``: the others do not agree on it), so with
    several processes ``sgrpo.run.faults`` ends them all; alone, ``sgrpo.fit`` prints it in one line."""


class DivergenceError(GuardError):
    """A run stopped because its loss or gradient was not finite several optimiser steps in a row."""


class DivergenceWatch:
    """Counts optimiser steps skipped because their loss or gradient was not finite; stops after ``steps`` in a row.

    A skipped step changes no weight (its gradients are dropped before the optimiser runs), so the weights,
    and every checkpoint and export of them, stay finite. ``observe`` takes the decision every process
    agreed on (``sgrpo.train.update``), so every process raises at the same step.
    """

    def __init__(self, steps: int = 3) -> None:
        if steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {steps}")
        self.steps = steps
        self.streak = 0  # optimiser steps skipped in a row
        self.skipped = 0  # optimiser steps skipped in this run (since this process started)
        self.hint = ""

    def observe(self, skipped: bool, step: int, hint: str) -> None:
        """Count one optimiser step of training step ``step`` (1-based); raise on the ``steps``-th skip in a row.
        ``hint``: the likely cause, with the settings to change."""
        self.streak = self.streak + 1 if skipped else 0
        self.skipped += int(skipped)
        self.hint = hint
        if self.streak >= self.steps:
            raise DivergenceError(
                f"training diverged at step {step}: the loss or gradient was not finite (NaN or infinite) for "
                f"{self.streak} optimiser steps in a row, none of them applied, so the weights and checkpoints are "
                f"finite; likely cause: {hint}; resume from a checkpoint with a lower lr (--ckpt_path last "
                f"--resume_changes allow), or raise model.max_nonfinite_steps"
            )

    def finish(self, step: int) -> None:
        """At the end of a fit: a run whose last optimiser step was skipped ended diverged (its weights give a
        non-finite loss), fewer than ``steps`` skips or not: raise, before the export."""
        if self.streak:
            raise DivergenceError(
                f"training diverged: it ended at step {step} on {self.streak} skipped optimiser step(s) in a row whose "
                f"loss or gradient was not finite, so the trained model was not exported (the checkpoints hold the "
                f"finite weights before them); likely cause: {self.hint}; resume from a checkpoint with a lower lr"
            )


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
        self.pending: RewardFailureError | None = None  # raised once the failing step's metrics are logged
        self._before: tuple[int, int] | None = None  # (the step observed last, the streak before it)

    def observe(self, failures: float, total: int, strategy, step: int) -> float:
        """Count step ``step``'s (0-based: the steps done before it) ``failures`` of ``total`` rewards (this
        process's); on the ``steps``-th bad step keep the error for ``raise_pending``, so that the step trains and
        logs its metrics first. Returns the step's failures over every process (``train/reward/failures``: each
        process's own, averaged by the logger, read 1/world of the count)."""
        counts = torch.tensor([float(failures), float(total)], dtype=torch.float64, device=strategy.root_device)
        failed, scored = strategy.reduce(counts, reduce_op="sum").tolist()
        self._before = (step, self.streak)
        self.streak = self.streak + 1 if scored and failed >= self.share * scored else 0
        if self.streak >= self.steps:
            self.pending = RewardFailureError(
                f"the reward failed for {failed:.0f} of {scored:.0f} completions, and for at least {self.share:.0%} "
                f"of them {self.steps} steps in a row: a failed scoring counts as a wrong answer, so this run "
                f"trains nothing; the first failure's error is in the log above (fix the reward, or raise "
                f"model.reward_failure_share / model.reward_failure_steps)"
            )
        return failed

    def streak_at(self, done: int) -> int:
        """The streak once ``done`` steps are done: the step under way (scored, not yet trained) is not counted (a
        stop saves the last step's end, and the resumed run scores that step again)."""
        return self._before[1] if self._before is not None and self._before[0] >= done else self.streak

    def raise_pending(self) -> None:
        """Raise the error ``observe`` kept, if any (after the step's metrics were logged)."""
        if self.pending is not None:
            raise self.pending


def guard_state(reward: RewardFailureWatch, divergence: DivergenceWatch, done: int) -> dict:
    """What a checkpoint of the state after ``done`` steps keeps of the guards: their streaks as of that step's end
    (a resumed run goes on counting where the interrupted one stood, as an uninterrupted run would: a run that ended
    diverged is not exported by resuming it) and the hint."""
    return {"reward_failure_streak": reward.streak_at(done), "nonfinite_streak": divergence.streak,
            "nonfinite_hint": divergence.hint}  # fmt: skip


def restore_guards(state: dict, reward: RewardFailureWatch, divergence: DivergenceWatch) -> None:
    """``guard_state``'s streaks back into the guards (a checkpoint from before they were kept: 0)."""
    reward.streak = int(state.get("reward_failure_streak", 0))
    divergence.streak = int(state.get("nonfinite_streak", 0))
    divergence.hint = str(state.get("nonfinite_hint", ""))
