"""REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740)."""

from __future__ import annotations

from torch import Tensor

from estimators.base import AdvantageEstimator, first_member_offsets


class RLOO(AdvantageEstimator):
    """RLOO: ``A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))`` (arXiv 2402.14740).

    Evaluated as ``(G r_i - sum_j r_j) / (G-1)`` on ``r - r_1`` (exact on binary rewards up to the final
    division, and exactly 0 on constant groups).
    Exact finite-group weight: c_G(p) = G, so the expected update is G * grad p.
    """

    def _advantages(self, rewards: Tensor) -> Tensor:
        g = rewards.shape[-1]
        d = first_member_offsets(rewards)  # shift invariant; a constant group is exact zeros
        total = d.sum(-1, keepdim=True)
        return d.mul_(g).sub_(total).div_(g - 1)
