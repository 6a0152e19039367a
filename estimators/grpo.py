"""GRPO's z-score advantage (DeepSeekMath, arXiv 2402.03300)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator, first_member_offsets


class GRPO(AdvantageEstimator):
    """GRPO: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (arXiv 2402.03300).

    ``std="sample"`` (Bessel, ddof 1) is the default, as torch's ``std`` in TRL, verl and oat;
    ``"population"`` uses ddof 0. Constant groups get exactly 0: the rewards are first offset by
    the group's first member, which makes a constant group exact zeros (a float mean of equal values
    can miss them by an ulp, and dividing that noise by eps would not give 0). Large-group weight
    1/sqrt(p(1-p)).
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
        # centred via the first member (shift invariance): a constant group is exact zeros here,
        # so its numerator is exactly 0 (a float mean of equal values can miss them by an ulp)
        centred = first_member_offsets(rewards)  # [B, G]
        centred.sub_(centred.mean(-1, keepdim=True))
        ddof = 1 if self.std == "sample" else 0
        scale = torch.linalg.vector_norm(centred, dim=-1, keepdim=True).div_(math.sqrt(g - ddof))
        scale.add_(self.eps)
        if self.eps == 0:
            scale.masked_fill_(scale == 0, math.inf)  # constant groups: 0 / inf = 0, not 0 / 0
        return centred.div_(scale)
