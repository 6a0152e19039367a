"""Dr.GRPO's mean-centred advantage (Understanding R1-Zero-like training, arXiv 2503.20783)."""

from __future__ import annotations

from torch import Tensor

from estimators.base import AdvantageEstimator, first_member_offsets


class DrGRPO(AdvantageEstimator):
    """Dr.GRPO: ``A_i = r_i - mean(r)`` (arXiv 2503.20783); no std normalisation.

    The paper pairs it with a loss that sums tokens and divides by a constant (``seq_sum_const``
    aggregation in sgrpo's policy loss); aggregation is a policy setting, not part of the estimator.
    Exact finite-group weight: c_G(p) = G - 1.
    """

    def _advantages(self, rewards: Tensor) -> Tensor:
        # centred on the first member (shift invariance): a constant group is exactly 0 - 0 = 0,
        # where a float mean of equal values could miss them by an ulp
        d = first_member_offsets(rewards)  # [B, G]
        return d.sub_(d.mean(-1, keepdim=True))
