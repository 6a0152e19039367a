"""``RunCheckpoint``: which state a run saves, and when; what is never saved (after an error mid-update, while a
checkpoint loads, after one process's error); and a signal's stop at a step's end.

Every checkpoint holds the state at the end of a training step, the one state a resume continues exactly. It is
written after Lightning logged that step's metrics (a failed write loses no metrics row), before the validation or
the step that follows, and its loop counters are those of that step's end (``step_end_loops``), noting whether the
validation due after it has run. Files: ``sgrpo.run.checkpoints``; faults: ``.faults``; signals: ``.signals``."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from sgrpo.rollout_stop import ROLLOUT_STOP
from sgrpo.run.checkpoints import (
    PARTIAL,
    checksum_path,
    hidden_name,
    link_checkpoint,
    numbered_checkpoints,
    replace_folder,
    resume_failure,
    tidy_resumed,
)
from sgrpo.run.faults import EVERY_PROCESS, fail_fast, loading_checkpoint
from sgrpo.run.folders import agree_checkpoint
from sgrpo.run.resume import ResumeError, apply_optimizer_settings, drop_scheduler_state, experiment_changes
from sgrpo.run.signals import Stopped, StoppedNow, StopRequests, forward_signal
from sgrpo.run.step_end import STEP_END, step_end_loops

log = logging.getLogger(__name__)

def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class RunCheckpoint(ModelCheckpoint):
    """sgrpo's checkpoints: ``last.ckpt`` (after every save, at a signal, at the end of fit) and ``stepN.ckpt``
    every ``checkpoint_every`` training steps, of which the newest ``keep_last`` are kept (None: all; 0: none,
    only ``last.ckpt``).

    Every checkpoint holds the state at the end of a training step, the one state a resume continues
    exactly: saved there, or (after an error in a single process, or one every process raises) where
    nothing has changed since, during the next step's rollout or a validation. Its loop counters are
    written as at that step's end (``step_end_loops``), recording whether the validation due after it
    is still to run. An error inside an update (after some of its optimiser steps), or while a
    checkpoint loads, saves nothing: ``last.ckpt`` stays what it was. Under several processes an error
    in one ends them all without saving (``sgrpo.run.faults``). A file of the same name is replaced, never
    versioned (``last-v1.ckpt``); writes are atomic (``AtomicCheckpointIO``; sharded folders are written
    hidden and swapped in).
    """

    def __init__(self, dirpath: str | None = None, checkpoint_every: int = 50, keep_last: int | None = 3) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 training steps, got {checkpoint_every}")
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps only last.ckpt) or null (keep all), got {keep_last}")
        super().__init__(
            dirpath=dirpath,
            filename="step{step}",
            monitor="step",  # "the highest steps" are the newest: save_top_k keeps the last N
            mode="max",
            save_top_k=-1 if keep_last is None else keep_last,
            every_n_train_steps=checkpoint_every,
            save_last=True,
            save_on_exception=False,  # on_exception decides
            auto_insert_metric_name=False,
            enable_version_counter=False,
        )
        self.stops = StopRequests()
        self._step_end: int | None = None  # the step whose end the weights and optimiser hold (None: mid-update)
        self._validation_pending = False  # the validation due after that step has not run yet
        self._checked_step: int | None = None  # the last step _after_step handled
        self._writing = False  # a checkpoint is being written
        self._training = False  # the training loop has started
        self.failed_resume: BaseException | None = None  # an error while the checkpoint to resume from loaded
        self._loaded_optimizers: list[str] | None = None  # the optimisers the checkpoint was trained with
        self.experiment: dict[str, str] = {}  # this run's experiment (sgrpo.run.resume), set by the CLI
        self.resume_changes = "refuse"  # or "allow": resume with another experiment, its changes applied
        self._loaded_experiment: dict[str, str] | None = None  # the checkpoint's
        self.resume_from = None  # the fit's --ckpt_path (an AgreedCheckpoint for "last"), set by the CLI
        self._written: tuple[str, tuple[int, bool]] | None = None  # the newest checkpoint written, and its state

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning warns that the folder "exists and is not empty": a resume's is, and a fresh run into a
        folder holding another run is refused before this (``sgrpo.run.folders``)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)
        if stage == "fit":
            agree_checkpoint(trainer, self.resume_from, experiment=self.experiment)  # one checkpoint, the same bytes
            self._written = None

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        ours = [_qualified(type(o)) for o in trainer.optimizers]
        if self._loaded_optimizers is not None and self._loaded_optimizers != ours:
            # its state loads into another optimiser's groups and fails at the first step (SGD: KeyError 'momentum')
            trained = ", ".join(self._loaded_optimizers)
            raise ResumeError(f"it was trained with {trained}, this run has {', '.join(ours)}")
        changes = experiment_changes(self._loaded_experiment, self.experiment) if self._loaded_experiment else []
        if changes:  # allowed (else refused while loading): applied, the optimiser's and the schedule's settings too
            apply_optimizer_settings(trainer.optimizers, trainer.lr_scheduler_configs, changes, pl_module.rollout_step)
            log.warning("--resume_changes allow: resuming with %s", "; ".join(changes))
        if trainer.ckpt_path and self.dirpath is not None:  # once the resume is accepted: a refused one moves nothing
            self._tidy_after_resume(trainer, Path(self.dirpath), Path(trainer.ckpt_path))
        self._step_end, self._validation_pending = None, False  # the loaded state is already on disk
        self._checked_step, self._training = None, True
        self.stops.install(forward_signal(trainer), now=lambda: self._may_save_now(trainer),
                           agree=lambda signum: self._at_step_end(trainer) and ROLLOUT_STOP.request(signum))
        self.stops.adopt_noted(trainer)  # a SIGTERM since the fit started (a sanity check)

    def on_train_end(self, trainer, pl_module) -> None:
        """The last step's checkpoints, if no validation followed it; ``last.ckpt`` also where a fit ended before
        ``max_steps`` (a callback stopped it)."""
        self._after_step(trainer, pl_module)
        self.stops.uninstall()
        self._training = False
        if self._step_end == trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self._step_end = None  # from here to the step's end the state is half a step

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validation_pending = False
        super().on_validation_end(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Never save after an error in one of several processes (``fail_fast``), mid-update, or while loading. An
        error (or a second Ctrl-C) between a step's end and its metrics row (``_at_step_end``) saves the step
        without its row: the step's work is kept over its row."""
        self.stops.uninstall(stopping=isinstance(exception, Stopped))
        loading = loading_checkpoint(trainer, exception)
        if trainer.world_size > 1 and not isinstance(exception, EVERY_PROCESS):
            line = None if not loading else f"error: {resume_failure(trainer.ckpt_path, exception)}"
            fail_fast(trainer, exception, line, status=2 if loading else None)
        saves = isinstance(exception, StoppedNow) or not isinstance(exception, Stopped)  # a stop saved its own
        if loading:
            self.failed_resume = exception
        elif saves and self._step_end == trainer.global_step and not self._writing:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        elif not isinstance(exception, Stopped) and trainer.is_global_zero and (self._writing or self._training):
            where = "a checkpoint write" if self._writing else "an update (after some of its optimiser steps)"
            log.warning("stopped inside %s: nothing saved; the newest checkpoint is as it was", where)

    def _may_save_now(self, trainer) -> bool:
        """A signal may stop the fit where it lands, saving ``last.ckpt`` then (``StoppedNow``): one process (more
        would have to agree first: the save is a collective), the state a step's end, no checkpoint being written.
        """
        return trainer.world_size == 1 and self._at_step_end(trainer)

    def _at_step_end(self, trainer) -> bool:
        """The state is a step's end (the rollout after it, a validation) whose metrics are logged (``_after_step``
        has run for it), no checkpoint being written. Several processes stop there only where they agree
        (``sgrpo.rollout_stop.RolloutStop``: during a rollout).

        Between ``on_train_batch_end`` (the step's end) and ``_after_step``, Lightning is still logging the step's
        metrics; a stop saved there kept the step and lost its ``metrics.jsonl`` row. A signal there is noted, and
        ``_after_step`` (next, once the row is written) saves and stops."""
        step = trainer.global_step
        return (
            self._training
            and self._step_end == step == self._checked_step
            and not (self._writing or trainer.sanity_checking)
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """A step has ended: its state is the one to save, once its metrics are logged (``_after_step``)."""
        self._step_end = trainer.global_step
        self._validation_pending = trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._after_step(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._after_step(trainer, pl_module)

    def _after_step(self, trainer, pl_module) -> None:
        """Once per step, after Lightning logged its metrics and before the validation or the step that follows:
        the periodic checkpoint, ``last.ckpt`` after the final step, and the stop a signal asked for.

        The final checkpoint, like the periodic ones, is saved before the validation that may follow, which
        its loop counters mark as still to run.
        """
        step = trainer.global_step
        if self._step_end != step or self._checked_step == step:
            return
        self._checked_step = step
        candidates = self._monitor_candidates(trainer)
        if step % self._every_n_train_steps == 0 and not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        signum = self.stops.agreed(pl_module.device)  # every process, every step: they stop at the same one
        final = 0 < trainer.max_steps <= step
        if (final or signum) and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, candidates)
        if signum:
            raise Stopped(signum)

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        """Lightning's, with ``step`` the training steps done: a validation logs a ``step`` metric (the steps of the
        weights it scored), which stays in ``callback_metrics`` and named the next checkpoints after it (step3.ckpt
        written as step2.ckpt)."""
        return super()._monitor_candidates(trainer) | {"step": torch.tensor(trainer.global_step, device="cpu")}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx=0) -> None:
        """A signal during a fit's validation: save the step before it (the validation runs again on resume)."""
        if trainer.state.fn != "fit" or trainer.sanity_checking or self._step_end != trainer.global_step:
            return
        signum = self.stops.agreed(pl_module.device)
        if signum:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            raise Stopped(signum)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if self._step_end is not None and self._step_end == trainer.global_step and "loops" in checkpoint:
            validating = trainer.validating
            epoch_steps = trainer.num_training_batches if trainer.max_epochs not in (None, -1) else math.inf
            checkpoint["loops"] = step_end_loops(
                checkpoint["loops"], self._step_end, self._validation_pending, validating, epoch_steps
            )
            checkpoint[STEP_END] = {
                "step": self._step_end,
                "validation_pending": self._validation_pending,
                "optimizers": [_qualified(type(o)) for o in trainer.optimizers],
                "experiment": self.experiment,
            }
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Step-end counters stand (the policy's repair of older, mid-step checkpoints does not apply)."""
        if STEP_END in checkpoint:
            mark = checkpoint[STEP_END]
            state = checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]
            state["_batches_that_stepped"] = mark["step"] - (2 if mark["validation_pending"] else 1)
            self._loaded_optimizers = mark.get("optimizers")
            self._loaded_experiment = mark.get("experiment")
        drop_scheduler_state(checkpoint, self._check_resume(trainer, checkpoint))
        super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def _check_resume(self, trainer, checkpoint: dict[str, Any]) -> list[str]:
        """Refuse, while it loads (on every process, before anything trains or exports), a checkpoint this run would
        continue as another experiment (``sgrpo.run.resume``: the model block, seed, precision, data files), unless
        ``--resume_changes allow``; and one whose step is past ``trainer.max_steps``: the fit would stop at once and
        overwrite the export with the checkpoint's policy (at ``max_steps`` exactly it re-exports it, as after an
        export a signal cut short). A fit that skips its loop never reached the refusal in ``on_train_start``."""
        changes = experiment_changes(self._loaded_experiment, self.experiment) if self._loaded_experiment else []
        if changes and self.resume_changes != "allow":
            raise ResumeError(
                f"it was trained as another experiment ({'; '.join(changes)}): resume with the run's config, or give "
                "--resume_changes allow to train on with these changes"
            )
        step = checkpoint.get("global_step")
        if step is not None and 0 <= trainer.max_steps < step:
            raise ResumeError(
                f"it holds step {step}, past --trainer.max_steps={trainer.max_steps}: give --trainer.max_steps={step} "
                "or more, or export it with python -m sgrpo.export"
            )
        return changes  # allowed ones

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The numbered checkpoints that ``keep_last`` prunes are the ``stepN.ckpt`` in this run's folder, wherever
        it now is. Lightning keeps its record of them only while the folder's path is unchanged: a run moved
        elsewhere (or reached by another path) and resumed never deleted an old checkpoint again."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
            super().load_state_dict(state_dict)
        if self.dirpath is None:
            return
        self._keep({str(path): step for path, step in numbered_checkpoints(Path(self.dirpath)).items()})

    def _tidy_after_resume(self, trainer, folder: Path, resumed: Path) -> None:
        """A resume's folder: checkpoints newer than the step resumed (a run branched from an older one) set aside in
        ``abandoned_stepS/``; then the oldest beyond ``keep_last``, never the one resumed from, deleted (Lightning
        deletes only while it holds exactly ``keep_last``: a folder written under a larger one kept growing)."""
        drop, kept = tidy_resumed(folder, trainer.global_step, resumed, self.save_top_k, trainer.is_global_zero,
                                  trainer.strategy.barrier)  # fmt: skip
        for path in drop:
            self._remove_checkpoint(trainer, path)
        self._keep(kept)

    def _keep(self, steps: dict[str, int]) -> None:
        """Lightning's record of the ``stepN.ckpt`` that ``keep_last`` prunes: ``steps`` (path: step)."""
        steps = {path: torch.tensor(step, device="cpu") for path, step in steps.items()}  # as Lightning records "step"
        self.best_k_models = steps
        if steps:  # "best" is the newest (monitor "step", mode "max"); the k-th the oldest kept
            self.best_model_path = max(steps, key=steps.get)
            self.best_model_score = steps[self.best_model_path]
            self.kth_best_model_path = min(steps, key=steps.get)
            self.kth_value = steps[self.kth_best_model_path]

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            checksum_path(Path(filepath)).unlink(missing_ok=True)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """Write the checkpoint, unless the newest one written holds this very state (the same step's end, the
        same validation still due): then ``filepath`` becomes a hard link to it (``stepN.ckpt`` and ``last.ckpt``
        of a periodic save were two full writes, each hashed in the training thread), or is left as it is if it
        is that one (``last.ckpt`` saved again at the final step or a signal)."""
        self._writing = True  # until the write is done: an error in it saves nothing more
        state = (trainer.global_step, self._validation_pending) if self._step_end == trainer.global_step else None
        written = self._written
        self._written = None  # until this write is done
        if state is not None and written is not None and written[1] == state:  # the same decision on every process
            if written[0] != filepath and trainer.is_global_zero:
                link_checkpoint(Path(written[0]), Path(filepath))
            trainer.strategy.barrier("RunCheckpoint.link")
            self._last_global_step_saved, self._last_checkpoint_saved = trainer.global_step, filepath
        else:
            self._save_checkpoint_atomically(trainer, filepath)
        self._written = (filepath, state) if state is not None else None
        self._writing = False

    def _save_checkpoint_atomically(self, trainer, filepath: str) -> None:
        # Lightning's ModelParallelStrategy writes a sharded checkpoint as a folder, in place and from
        # every process: write it under a hidden name, then swap it in from global rank 0.
        if not getattr(trainer.strategy, "_save_distributed_checkpoint", False):
            return super()._save_checkpoint(trainer, filepath)
        staged = hidden_name(Path(filepath), PARTIAL)
        super()._save_checkpoint(trainer, str(staged))
        if trainer.is_global_zero:
            replace_folder(staged, Path(filepath))
        trainer.strategy.barrier("RunCheckpoint.replace_folder")
        self._last_checkpoint_saved = filepath
