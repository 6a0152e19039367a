"""The update: policy losses (``PolicyLoss``, ``ClippedSurrogate``), the optimiser steps of one rollout
(``PolicyUpdate``: old and reference log-probs, micro-batches, gradient accumulation), the KL reference, and what
a training step logs. Config class paths are ``sgrpo.train.<Loss>``."""

from sgrpo.train.loss import BatchCounts, ClippedSurrogate, PolicyLoss, TokenBatch
from sgrpo.train.update import PolicyUpdate

__all__ = ["BatchCounts", "ClippedSurrogate", "PolicyLoss", "PolicyUpdate", "TokenBatch"]
