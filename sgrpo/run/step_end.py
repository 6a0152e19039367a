"""A step's end, as a checkpoint records it: Lightning's loop counters as they stand there (``step_end_loops``), and
the fit loop that runs the validation such a checkpoint owes when it resumes at ``max_steps`` (``RunFitLoop``);
``sgrpo.run.saving.RunCheckpoint`` writes them."""

from __future__ import annotations

import copy
import math
from typing import Any

from lightning.pytorch.loops.fit_loop import _FitLoop

#: a checkpoint's record of the step whose end it holds: ``{"step": N, "validation_pending": bool, "optimizers"}``
STEP_END = "sgrpo_step_end"


def step_end_loops(
    loops: dict[str, Any], step: int, validation_pending: bool, validating: bool, epoch_steps: float = math.inf
) -> dict[str, Any]:
    """Lightning's loop counters as they stand at the end of training step ``step`` (``on_train_batch_end``).

    A state saved later (during the validation after that step, or the next step's rollout, nothing
    having changed since) resumes as if saved there. Lightning resumes such a checkpoint with the next
    step and skips the validation due after ``step``; with ``validation_pending`` the counters say that
    validation was interrupted before its first batch, so it runs first, logged at its own step.
    In a fit in epochs of ``epoch_steps`` steps (``trainer.max_epochs``), the step's epoch is still under way
    at its end, though the end of fit marked it done (a resume went on in the next epoch after a stop at
    ``max_steps`` mid-epoch), and the epoch's last step is its last batch (Lightning then resumes in the next).
    """
    loops = copy.deepcopy(loops)
    fit = loops["fit_loop"]
    batches = fit["epoch_loop.batch_progress"]
    earlier = batches["total"]["ready"] - batches["current"]["ready"]  # batches of earlier epochs
    total = {"ready": step, "started": step, "processed": step, "completed": step - 1}
    current = {k: v - earlier for k, v in total.items()}
    batches.update(total=total, current=current, is_last_batch=current["ready"] >= epoch_steps)
    epochs = fit["epoch_progress"]
    if math.isfinite(epoch_steps) and epochs["total"]["processed"] == epochs["total"]["started"] > 0:
        for counts in (epochs["total"], epochs["current"]):  # under way again: started, not processed
            counts["processed"] = counts["completed"] = counts["started"] - 1
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = step - (2 if validation_pending else 1)
    if validation_pending:
        val = fit["epoch_loop.val_loop.batch_progress"]
        done = val["total"]["completed"] - (val["current"]["completed"] if validating else 0)
        val.update(
            total={"ready": done + 1, "started": done + 1, "processed": done, "completed": done},
            current={"ready": 1, "started": 1, "processed": 0, "completed": 0},
            is_last_batch=False,
        )
    return loops


class RunFitLoop(_FitLoop):
    """Lightning's fit loop, which also finishes a fit resumed at ``max_steps`` from a checkpoint whose validation is
    still due (``step_end_loops``: a kill or a signal after the final step's checkpoint, before that validation ran).
    Lightning's loop stopped at once at ``max_steps``, and the final validation was lost; now its epoch loop runs it,
    as it does the validation a checkpoint owes before a later step."""

    @classmethod
    def install(cls, trainer) -> None:
        """Put this loop in place of ``trainer``'s (a new trainer's: its data is attached later, by ``fit``)."""
        loop = cls(trainer, min_epochs=trainer.fit_loop.min_epochs, max_epochs=trainer.fit_loop.max_epochs)
        loop.epoch_loop = trainer.fit_loop.epoch_loop
        trainer.fit_loop = loop

    @property
    def done(self) -> bool:
        return super().done and not self.owes_validation

    @property
    def owes_validation(self) -> bool:
        """Restarted at ``max_steps`` from a checkpoint that owes a validation (its counters mark one begun, no batch
        of it done) that has not run yet. (A fit bounded by epochs stops as Lightning's does.)"""
        val = self.epoch_loop.val_loop
        total = val.batch_progress.total
        begun = total.started == total.ready and total.processed == total.started - 1
        at_max_steps = 0 <= self.max_steps <= self.epoch_loop.global_step
        return self.restarting and at_max_steps and begun and not val._has_run
