"""MaxRL's mean-normalised advantages (Tajwar et al. 2026, arXiv 2602.02710)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from estimators.base import AdvantageEstimator


class MaxRL(AdvantageEstimator):
    """MaxRL (arXiv 2602.02710), for rewards >= 0 with group mean mu = mean(r):

    - ``practical`` (the paper's Algorithm 1): ``A_i = r_i / mu - 1``, and 0 when mu = 0.
      c_G(p) = G (1 - (1-p)^(G-1)) / p: the order G-1 truncation (docs/theory.md §2.5), not order G.
    - ``cv_unbiased`` (the theory's control variate): ``r_i / mu - 1``, and -1 for every member
      when mu = 0. c_G(p) = G (1 - (1-p)^G) / p.
    - ``nocv`` (conditional estimator times G): ``A_i = r_i / mu``, and 0 when mu = 0.
      Same c_G as cv_unbiased.

    The official code also divides by G and adds 1e-6 to mu; both are global rescales left out here.
    Constant groups give 0 for ``practical``; ``cv_unbiased`` and ``nocv`` keep their definitions.
    """

    requires_nonnegative_rewards = True

    def __init__(self, variant: Literal["practical", "cv_unbiased", "nocv"] = "practical") -> None:
        if variant not in ("practical", "cv_unbiased", "nocv"):
            raise ValueError(f"variant must be 'practical', 'cv_unbiased' or 'nocv', got {variant!r}")
        self.variant = variant

    def _advantages(self, rewards: Tensor) -> Tensor:
        rmax = rewards.amax(-1, keepdim=True)  # [B, 1]
        constant = rmax == rewards.amin(-1, keepdim=True)
        unsolved = rmax == 0  # rewards >= 0, so mu = 0 exactly for these (all-zero) groups
        mu = rewards.mean(-1, keepdim=True)
        # A = offset + r / divisor per group, in one fused pass; r / inf = +0 (rewards >= 0)
        if self.variant == "nocv":
            # constant groups divide by their own value (exactly 1); all-zero groups give 0
            divisor = torch.where(constant, torch.where(unsolved, math.inf, rmax), mu)
            offset = torch.zeros_like(mu)
        else:
            divisor = torch.where(constant, math.inf, mu)
            unsolved_value = -1.0 if self.variant == "cv_unbiased" else 0.0
            offset = torch.where(constant, torch.where(unsolved, unsolved_value, 0.0), -1.0)
        return torch.addcdiv(offset, rewards, divisor)
