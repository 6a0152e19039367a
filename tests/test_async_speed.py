"""What makes asynchronous rollouts pay (issue 35's speed goal): the trainer and its producer share the trainer's
threads once they overlap (S >= 1), and at S = 0 both keep them (the synchronous run's numerics). The proximal
forward a stale update skips is proved in tests/test_offpolicy_update.py."""

from __future__ import annotations

from types import SimpleNamespace

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

    def __init__(self, spec, weights, timeout, shapes=None) -> None:
        Recorder.started.append(spec)

    def close(self) -> None:
        pass


class Policy(AsyncRollouts):
    """The attributes ``start_producer`` reads, without a model."""

    model_path, model_dtype, tokenizer, rollout, model = "unused", "float32", None, HFRollout(), torch.nn.Module()
    seed, global_rank, group_size, device, producer_timeout = 0, 0, 2, torch.device("cpu"), 60.0
    _refill = None  # dynamic sampling's refill stream (unused here)
    trainer = SimpleNamespace(precision="32-true")  # the sampling precision's source

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


def test_the_benchmark_probe_counts_cpu_per_step_without_the_startup_steps_and_validations():
    """benchmarks._async_probe.per_step by hand: 6 steps, the first SKIP = 2 left out; steps of 1 s wall holding
    0.1 s of trainer CPU and 0.05 s of producer CPU, but a validation of 10 s (2 s CPU) after step 3: the trainer's
    CPU and the loop's wall are means over the other intervals, the producer's its total over the steps."""
    from benchmarks._async_probe import SKIP, per_step

    marks, wall, cpu, producer = [], 0.0, 0.0, 0.0
    for step in range(6):
        marks.append({"kind": "start", "wall": wall, "cpu": cpu, "producer": producer})
        wall, cpu, producer = wall + 1.0, cpu + 0.1, producer + 0.05
        marks.append({"kind": "end", "wall": wall, "cpu": cpu, "producer": producer})
        if step == 3:
            wall, cpu = wall + 10.0, cpu + 2.0
    got = per_step(marks)
    assert SKIP == 2 and got["steps"] == 2  # intervals 2-3 and 4-5 (3-4 held the validation)
    assert got["trainer_cpu_s"] == pytest.approx(0.1) and got["loop_s"] == pytest.approx(1.0)
    assert got["producer_cpu_s"] == pytest.approx(0.05)  # (6 - 2) steps' 0.2 s over 4 steps
