"""Advantage estimators: group rewards [B, G] -> advantages [B, G], each with its exact theory."""

from estimators.base import AdvantageEstimator
from estimators.budget import BUCKETS, budget_mass, budget_shares, difficulty_bucket, gradient_budget
from estimators.dr_grpo import DrGRPO
from estimators.grpo import GRPO
from estimators.maxrl import MaxRL
from estimators.rloo import RLOO
from estimators.softmax_grpo import SoftmaxGRPO

#: every shipped estimator class; the conformance tests run over this list
ESTIMATORS: tuple[type[AdvantageEstimator], ...] = (GRPO, DrGRPO, RLOO, MaxRL, SoftmaxGRPO)

__all__ = [
    "AdvantageEstimator",
    "BUCKETS",
    "DrGRPO",
    "ESTIMATORS",
    "GRPO",
    "MaxRL",
    "RLOO",
    "SoftmaxGRPO",
    "budget_mass",
    "budget_shares",
    "difficulty_bucket",
    "gradient_budget",
]
