"""What makes asynchronous rollouts pay (issue 35's speed goal): the trainer and its producer share the trainer's
threads once they overlap (S >= 1), and at S = 0 both keep them (the synchronous run's numerics). The proximal
forward a stale update skips is proved in tests/test_offpolicy_update.py."""

from __future__ import annotations

import pytest
import torch

from sgrpo.rollout import HFRollout
from sgrpo.train import asynchronous
from sgrpo.train.asynchronous import AsyncRollouts, thread_split


@pytest.mark.parametrize(
    "threads, staleness, device, split",
    [
        (2, 1, "cpu", (1, 1)),  # the quickstart on 2 cores: one each, not two each
        (4, 2, "cpu", (2, 2)),
        (3, 1, "cpu", (2, 1)),  # an odd budget: the trainer keeps the extra thread
        (1, 4, "cpu", (1, 1)),  # never below one
        (2, 0, "cpu", (2, 2)),  # S = 0: they never run at once; the synchronous run's threads, both
        (8, 1, "cuda:0", (8, 8)),  # on a GPU the host threads only launch kernels
    ],
)
def test_thread_split_shares_the_trainers_threads_only_when_the_two_overlap(threads, staleness, device, split):
    assert thread_split(threads, staleness, device) == split


class Recorder:
    """Stands in for ``RolloutProducer``: keeps the spec it was started with."""

    started: list = []

    def __init__(self, spec, weights, timeout) -> None:
        Recorder.started.append(spec)

    def close(self) -> None:
        pass


class Policy(AsyncRollouts):
    """The attributes ``start_producer`` reads, without a model."""

    model_path, model_dtype, tokenizer, rollout = "unused", "float32", None, HFRollout()
    seed, global_rank, group_size, device, producer_timeout = 0, 0, 2, torch.device("cpu"), 60.0

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness

    def _plain_weights(self):
        return []


@pytest.mark.parametrize("staleness, during", [(1, (1, 1)), (0, (2, 2))])
def test_the_producer_and_the_trainer_run_on_the_split_and_the_trainer_gets_its_threads_back(monkeypatch, staleness,
                                                                                            during):  # fmt: skip
    monkeypatch.setattr(asynchronous, "RolloutProducer", Recorder)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        policy = Policy(staleness)
        policy.start_producer(stream=type("Stream", (), {"batch": None})(), first_step=0, last_step=3)
        assert (torch.get_num_threads(), Recorder.started[-1].threads) == during
        policy.stop_producer()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
