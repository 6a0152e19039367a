"""One step's groups for ``GRPOPolicy``: sample G completions per prompt (seeded so a resume draws the same),
score them with the task, and with ``dynamic_sampling`` drop constant groups and sample more prompts (DAPO's
filter). ``GroupCollection`` is mixed into the policy, as ``PolicyUpdate`` is."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from estimators.base import constant_groups
from sgrpo.distributed import any_process
from sgrpo.rollout.episodes import EpisodeError
from sgrpo.rollout.vllm_http import ServerError
from sgrpo.rollout_stop import ROLLOUT_STOP
from sgrpo.run.data import mix_seed
from sgrpo.run.guards import EnvironmentFailure
from sgrpo.run.signals import StoppedNow
from sgrpo.types import Example, RolloutBatch


class GroupCollection:
    """``collect``, ``sample``, ``score`` and ``informative_groups`` of ``GRPOPolicy`` (its rollout engine, task,
    group size, seeds and dynamic-sampling settings)."""

    def collect(self, examples: list[Example]) -> tuple[RolloutBatch, Tensor, Tensor, dict[str, Tensor], dict]:
        """Sample and score one step's groups: rollout, rewards, success, reward components, metrics.

        With ``dynamic_sampling``, groups whose rewards are all equal carry no signal (advantage 0 under
        every zero-sum estimator): they are dropped and more prompts sampled, round after round (as
        DAPO and verl's filter_groups do), until this step's ``prompts_per_step`` informative groups are
        collected or ``max_sampling_rounds`` rounds have run. A round's prompts are ones the step has not drawn
        (``sgrpo.run.data.RefillStream``) while there are any. Every process runs as many rounds (their
        rollouts may be collectives). Logs ``train/sampling/rounds`` and ``train/sampling/groups_dropped``;
        ``train/zero_variance_groups`` counts every sampled group.
        """
        started = time.perf_counter()
        rollout = self.sample(examples)
        scored = time.perf_counter()
        rewards, success, parts, log = self.score(examples, rollout)
        log["rollout_s"] = scored - started
        scored_rows = len(examples) * self.group_size
        if not self.dynamic_sampling:
            log["train/zero_variance_groups"] = constant_groups(rewards).float().mean()
            failures = log["train/reward/failures"]  # this process's: logged as every process's (the guard's sum)
            log["train/reward/failures"] = self.reward_watch.observe(failures, scored_rows, self.trainer.strategy,
                                                                     self.rollout_step)  # fmt: skip
            return rollout, rewards, success, parts, log
        kept, sampled, rounds = [], 0, 0
        while True:
            informative = (~constant_groups(rewards).squeeze(-1)).nonzero().squeeze(-1)
            chosen = {name: values[informative] for name, values in parts.items()}
            kept.append((rollout.select_groups(informative), rewards[informative], success[informative], chosen))
            sampled, rounds = sampled + len(rewards), rounds + 1
            have = sum(len(part[1]) for part in kept)
            if rounds == self.max_sampling_rounds or not any_process(have < len(examples), self.device):
                break
            more = self._refill.batch(self.rollout_step, rounds)  # prompts this step has not drawn
            started = time.perf_counter()
            rollout = self.sample(more, rounds)
            log["rollout_s"] += time.perf_counter() - started
            rewards, success, parts, refill = self.score(more, rollout)
            log["train/reward/failures"] += refill["train/reward/failures"]
            scored_rows += len(more) * self.group_size
        # the step's failures over every round, counted once (the guard counts steps, not rounds)
        failures = log["train/reward/failures"]
        log["train/reward/failures"] = self.reward_watch.observe(failures, scored_rows, self.trainer.strategy,
                                                                 self.rollout_step)  # fmt: skip
        dropped = torch.tensor(float(sampled - have), dtype=torch.float64, device=self.device)
        log |= {
            "train/sampling/rounds": float(rounds),
            "train/sampling/groups_dropped": float(self.trainer.strategy.reduce(dropped, reduce_op="sum")),  # a count
            "train/zero_variance_groups": (sampled - have) / sampled,
        }
        if have == 0:  # nothing informative: the last round's groups, all dropped by informative_groups
            return rollout, rewards, success, parts, log
        groups = torch.arange(min(have, len(examples)), device=self.device)  # this step's share, no more
        rollout = RolloutBatch.cat([part[0] for part in kept]).select_groups(groups)
        rewards, success = (torch.cat([part[i] for part in kept])[groups] for i in (1, 2))
        parts = {name: torch.cat([part[3][name] for part in kept])[groups] for name in parts}
        return rollout, rewards, success, parts, log

    def sample(self, examples: list[Example], sampling_round: int = 0) -> RolloutBatch:
        """``group_size`` completions per prompt, seeded from (seed, step, rank[, round]): a resumed run draws
        the same. With ``async_rollout`` the producer's groups of this step or round (sampled with this seed).

        Under several processes a signal during the rollout stops every process at its end or at one of its checks
        (``sgrpo.rollout_stop.RolloutStop``): ``StoppedNow``, which saves ``last.ckpt`` (the last step's end)."""
        if getattr(self, "_producer", None) is not None:
            return self.take_rollout(examples, sampling_round)
        seed = mix_seed(self.seed, self.rollout_step, self.global_rank, *([sampling_round] if sampling_round else []))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            rollout, signum = ROLLOUT_STOP.run(lambda: self.generate_with(self.rollout, examples, self.group_size),
                                               self.device, gone=(ServerError,))  # fmt: skip
        if signum:  # a signal on some process during the rollout: every process stops here, the last step's end
            raise StoppedNow(signum)
        return rollout

    def generate_with(self, engine, examples: list[Example], n: int, greedy: bool = False) -> RolloutBatch:
        """``n`` samples per example from ``engine``: completions, or with ``environment`` multi-turn episodes."""
        if getattr(self, "environment", None) is None:
            return engine.generate(self.model, self.tokenizer, examples, n, greedy=greedy)
        try:
            return engine.generate_episodes(self.model, self.tokenizer, examples, n, self.environment, greedy=greedy)
        except EpisodeError as err:  # the step fails, naming the environment (as a failing reward stops the run)
            raise EnvironmentFailure(f"{err}; fix the environment (docs/environments.md)") from err

    def informative_groups(self, rewards: Tensor) -> Tensor:
        """``[B]`` bool: the groups the update trains on (with ``dynamic_sampling``, not the constant ones)."""
        if not self.dynamic_sampling:
            return torch.ones_like(rewards[:, 0], dtype=torch.bool)
        return ~constant_groups(rewards).squeeze(-1)

    def score(self, examples: list[Example], rollout: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, Tensor], dict]:
        """Rewards, success flags and each reward component ``[B, G]`` for a rollout, and the metrics to log.

        ``train/reward/failures`` counts its failed scorings; ``collect`` hands the step's, every round's together,
        to ``sgrpo.run.guards.RewardFailureWatch`` (which stops the run when too many failed too long).
        """
        repeated = [ex for ex in examples for _ in range(self.group_size)]
        with torch.device("cpu"):  # tasks (user code) build host tensors whatever the default device is
            result = self.task.score(repeated, rollout.completions)  # reward and success, graded once if they can be
        rewards = result.total.to(self.device, torch.float32).view(len(examples), self.group_size)
        if rollout.episodes is not None:  # the environment's per-turn rewards, added to the task's
            turn_rewards = torch.tensor([e.reward for e in rollout.episodes], dtype=rewards.dtype, device=self.device)
            turn_rewards = turn_rewards.view_as(rewards)
            rewards = rewards + turn_rewards
        success = result.success.to(self.device).view_as(rewards)
        log = {
            "train/reward": rewards.mean(),
            "train/success_rate": success.float().mean(),
            "train/reward_std": rewards.std(-1).mean(),
            "train/reward/failures": float(result.failures),
        }
        parts = {name: values.to(self.device).float().view_as(rewards) for name, values in result.parts.items()}
        log |= {f"train/reward/{name}": values.mean() for name, values in parts.items()}
        return rewards, success, parts, log
