"""What a training step logs over several processes: every process logs the same keys in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgrpo.train.step_logging import StepLogging
from tests.gloo_pair import run_pair


class Recorder(StepLogging):
    """StepLogging with Lightning's ``log`` replaced by a recorder of what each call would reduce."""

    def __init__(self) -> None:
        self._trainer = self.trainer = SimpleNamespace(world_size=2)
        self.device = torch.device("cpu")
        self.logged: list[tuple[str, float]] = []

    def log(self, key, value, prog_bar=False, sync_dist=False) -> None:
        assert sync_dist
        self.logged.append((key, float(value)))


def _log_on(rank: int, values: dict) -> list:
    recorder = Recorder()
    recorder._log_mean(values)
    return recorder.logged


def test_processes_whose_reward_parts_differ_log_the_same_keys_in_one_order(tmp_path):
    """Process 1's reward failed, so it reports the reward's own name as its part and not the parts process 0
    reports, which it also builds in another order. Each process logged its own keys in its own order: Lightning
    reduced process 0's parity with process 1's twopart, then a key with none (a hang or an abort). Now both log
    the union, sorted, a key a process lacks counting 0 there."""
    values = [
        {"train/reward": 0.5, "train/reward/parity": 1.0, "train/reward/nonempty": 0.25, "train/loss": 2.0},
        {"train/reward/twopart": 0.0, "train/reward": 0.0, "train/loss": 3.0},
    ]
    logged = run_pair(_log_on, values, tmp_path)
    keys = sorted(set(values[0]) | set(values[1]))
    assert [k for k, _ in logged[0]] == [k for k, _ in logged[1]] == keys
    assert dict(logged[1])["train/reward/parity"] == 0.0 and dict(logged[0])["train/reward/twopart"] == 0.0
    assert dict(logged[0])["train/loss"] == 2.0 and dict(logged[1])["train/loss"] == 3.0


def _means_on(rank: int, advantages: torch.Tensor) -> dict:
    import torch.distributed as dist

    from sgrpo.train.step_logging import global_means

    def add_up(sums):
        dist.all_reduce(sums)
        return sums

    pairs = {"train/advantage/abs_mean": (advantages.abs().sum(), advantages.numel()),
             "train/completion/truncated": (torch.tensor(0.0), 0)}  # fmt: skip
    return {k: float(v) for k, v in global_means(pairs, add_up).items()}


def test_step_means_weigh_each_process_by_what_it_holds(tmp_path):
    """After dynamic sampling's last round one process kept 1 group and the other 3 (found by a review): the mean
    of the two processes' means (here (4 + 1) / 2 = 2.5) weighed the single group as much as the three; the step's
    mean over its 4 groups' 8 advantages is (2 x 4 + 6 x 1) / 8 = 1.75. A key with no value anywhere is 0."""
    held = [torch.tensor([[4.0, -4.0]]), torch.tensor([[1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]])]
    logged = run_pair(_means_on, held, tmp_path)
    assert logged[0] == logged[1] == {"train/advantage/abs_mean": 1.75, "train/completion/truncated": 0.0}


def _episode_means_on(rank: int, turns: list[int]) -> dict:
    import torch.distributed as dist

    from sgrpo.train.step_logging import episode_log, global_means
    from sgrpo.types import Episode

    def add_up(sums):
        dist.all_reduce(sums)
        return sums

    rollout = SimpleNamespace(episodes=[Episode(messages=[], turns=t, tool_calls=t - 1) for t in turns])
    return {k: float(v) for k, v in global_means(episode_log(rollout), add_up).items()}


def test_episode_means_weigh_each_process_by_its_episodes(tmp_path):
    """Dynamic sampling left process 0 with 1 group of 4 episodes of 3 turns and process 1 with 8 groups of 4 of 1
    turn (found by a review): the logged mean of the two processes' means was 2 turns; over the 36 episodes it is
    (4 x 3 + 32 x 1) / 36 = 11/9."""
    logged = run_pair(_episode_means_on, [[3] * 4, [1] * 32], tmp_path)
    assert logged[0] == logged[1]
    assert abs(logged[0]["train/episode/turns"] - 11 / 9) < 1e-6
    assert abs(logged[0]["train/episode/tool_use_rate"] - 4 / 36) < 1e-6
    assert abs(logged[0]["train/episode/tool_calls"] - 8 / 36) < 1e-6
