"""GRPO's z-score advantage (DeepSeekMath, arXiv 2402.03300)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator


class GRPO(AdvantageEstimator):
    """GRPO: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (arXiv 2402.03300).

    ``std="sample"`` (Bessel, ddof 1) is the default, as torch's ``std`` in TRL, verl and oat;
    ``"population"`` uses ddof 0. Constant groups get exactly 0 (detected, not left to the
    arithmetic, which would divide float noise by eps). Large-group weight 1/sqrt(p(1-p)).
    """

    def __init__(self, std: Literal["sample", "population"] = "sample", eps: float = 1e-6) -> None:
        if std not in ("sample", "population"):
            raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {eps}")
        self.std = std
        self.eps = eps

    def _advantages(self, rewards: Tensor) -> Tensor:
        g = rewards.shape[-1]
        rmin, rmax = torch.aminmax(rewards, dim=-1, keepdim=True)  # [B, 1]
        constant = rmax == rmin
        # a constant group is centred on its own value, so its numerator is exactly +0
        mean = torch.where(constant, rmax, rewards.mean(-1, keepdim=True))
        centred = rewards - mean  # [B, G]
        ddof = 1 if self.std == "sample" else 0
        std = torch.linalg.vector_norm(centred, dim=-1, keepdim=True) / math.sqrt(g - ddof)
        inv_scale = torch.where(constant, 0.0, 1 / (std + self.eps))  # eps = 0 would give 1/0 there
        return centred.mul_(inv_scale)
