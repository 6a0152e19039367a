"""``train/async/*`` count the groups a step trains: under dynamic sampling a step whose every round was constant
trains none (``collect`` hands back its last round, every group dropped by ``informative_groups``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from estimators import SoftmaxGRPO
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.types import RolloutBatch
from tasks.synthetic import SyntheticTask
from tests.test_async import SHIPPED


def async_metrics(versions: list[int], trained: list[bool], trained_at: int) -> dict[str, float]:
    """What ``async_logs`` logs for one process's rollout of groups of 2 rows sampled under ``versions`` (per row)."""
    task = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2)
    policy = GRPOPolicy(SHIPPED, task, SoftmaxGRPO(temperature=0.5), HFRollout(max_new_tokens=4), group_size=2,
                        prompts_per_step=len(trained), async_rollout=True, max_staleness=2)  # fmt: skip
    logged: dict[str, float] = {}
    policy.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    policy.log_dict = lambda values, **kwargs: logged.update({k: float(v) for k, v in values.items()})
    policy._trainer = SimpleNamespace(strategy=SimpleNamespace(reduce=lambda sums, reduce_op: sums))  # one process
    policy._async = {"wait_s": 0.0, "weight_sync_s": 0.0, "groups_sampled": 2 * len(trained)}
    n = len(versions)
    rollout = RolloutBatch(torch.zeros(n, 5, dtype=torch.long), torch.ones(n, 5, dtype=torch.long),
                           torch.ones(n, 3, dtype=torch.bool), ["x"] * n, torch.zeros(n, dtype=torch.bool), 2,
                           versions=torch.tensor(versions))  # fmt: skip
    policy.async_logs(rollout, trained_at, torch.tensor(trained))
    return logged


def test_staleness_and_groups_count_only_the_groups_trained():
    """Groups sampled under versions 4 and 2, trained at step 4, the stale one dropped (constant): 1 group trained,
    at staleness 0 (the dropped group's 2 used to count, and to make the mean 1 and the max 2)."""
    logged = async_metrics([4, 4, 2, 2], [True, False], trained_at=4)
    assert logged["train/async/groups"] == 1.0 and logged["train/async/groups_sampled"] == 4.0
    assert logged["train/async/staleness_max"] == 0.0 and logged["train/async/staleness_mean"] == 0.0
    assert [logged[f"train/async/staleness_hist/{k}"] for k in range(3)] == [1.0, 0.0, 0.0]


def test_a_step_that_trains_no_group_counts_none():
    logged = async_metrics([3, 3, 3, 3], [False, False], trained_at=4)
    assert logged["train/async/groups"] == 0.0 and logged["train/async/groups_sampled"] == 4.0
    assert logged["train/async/staleness_max"] == 0.0 and logged["train/async/staleness_mean"] == 0.0
    assert [logged[f"train/async/staleness_hist/{k}"] for k in range(3)] == [0.0, 0.0, 0.0]
