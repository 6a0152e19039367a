"""REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740)."""

from __future__ import annotations

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator


class RLOO(AdvantageEstimator):
    """RLOO: ``A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))`` (arXiv 2402.14740).

    Evaluated as ``(G r_i - sum_j r_j) / (G-1)`` (exact on binary rewards up to the final division).
    Exact finite-group weight: c_G(p) = G, so the expected update is G * grad p.
    """

    def _advantages(self, rewards: Tensor) -> Tensor:
        g = rewards.shape[-1]
        rmin, rmax = torch.aminmax(rewards, dim=-1, keepdim=True)  # [B, 1]
        # for a constant group use G * r as its sum, so that G r_i - sum is exactly 0
        total = torch.where(rmax == rmin, rmax * g, rewards.sum(-1, keepdim=True))
        return torch.mul(rewards, g).sub_(total).div_(g - 1)
