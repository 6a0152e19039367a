"""A run's life: config checks before anything loads (preflight), run folders and their lock, checkpoint files and
when they are written, resume and what it may change, faults and signals across processes, and the resumable
prompt streams a run trains on."""

from sgrpo.run.checkpoints import AtomicCheckpointIO
from sgrpo.run.data import EpochStepBatches, PromptBatch, StepBatches
from sgrpo.run.folders import RunRefused
from sgrpo.run.guards import DivergenceError, DivergenceWatch, GuardError, RewardFailureError, RewardFailureWatch
from sgrpo.run.resume import ResumeError
from sgrpo.run.saving import RunCheckpoint

__all__ = [
    "AtomicCheckpointIO", "DivergenceError", "DivergenceWatch", "EpochStepBatches", "GuardError", "PromptBatch",
    "ResumeError", "RewardFailureError", "RewardFailureWatch", "RunCheckpoint", "RunRefused", "StepBatches",
]
