"""The update: policy losses (``PolicyLoss``, ``ClippedSurrogate``), the optimiser steps of one rollout
(``PolicyUpdate``: old and reference log-probs, micro-batches, gradient accumulation), the KL reference, and what
a training step logs. Config class paths are ``sgrpo.train.<Loss>`` and, for the importance corrections of
stale or external rows (``ClippedSurrogate``'s ``corrections``), ``sgrpo.train.<Correction>``."""

from sgrpo.train.correction import (
    GeometricMeanMask,
    ImportanceCorrection,
    K3Rejection,
    SequenceMask,
    TokenMask,
    TokenTruncation,
)
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, PolicyLoss, TokenBatch
from sgrpo.train.update import PolicyUpdate

__all__ = [
    "BatchCounts", "ClippedSurrogate", "GeometricMeanMask", "ImportanceCorrection", "K3Rejection", "PolicyLoss",
    "PolicyUpdate", "SequenceMask", "TokenBatch", "TokenMask", "TokenTruncation",
]  # fmt: skip
