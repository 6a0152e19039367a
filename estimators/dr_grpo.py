"""Dr.GRPO's mean-centred advantage (Understanding R1-Zero-like training, arXiv 2503.20783)."""

from __future__ import annotations

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator


class DrGRPO(AdvantageEstimator):
    """Dr.GRPO: ``A_i = r_i - mean(r)`` (arXiv 2503.20783); no std normalisation.

    The paper pairs it with a loss that sums tokens and divides by a constant (``seq_sum_const``
    aggregation in sgrpo's policy loss); aggregation is a policy setting, not part of the estimator.
    Exact finite-group weight: c_G(p) = G - 1.
    """

    def _advantages(self, rewards: Tensor) -> Tensor:
        rmin, rmax = torch.aminmax(rewards, dim=-1, keepdim=True)  # [B, 1]
        # a float mean of equal values can miss them by an ulp: centre constant groups on their value
        mean = torch.where(rmax == rmin, rmax, rewards.mean(-1, keepdim=True))
        return rewards - mean
