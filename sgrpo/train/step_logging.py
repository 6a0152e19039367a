"""What a training step logs: its metrics (means over every process; maxima, minima and the gradient
budget by difficulty reduced over processes) and, every ``log_completions_every`` steps, a few groups of
completions (``sgrpo.eval.completions``). ``StepLogging`` is mixed into ``GRPOPolicy``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from estimators import SoftmaxGRPO, budget_mass, budget_shares
from estimators.softmax_grpo import log_mgf
from sgrpo.eval.completions import completion_rows, drop_rows_from, write_rows
from sgrpo.eval.metrics import episode_values


class StepLogging:
    """The logging half of ``GRPOPolicy.training_step``."""

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.reward_watch.raise_pending()  # a reward that kept failing stops the run once its last step is logged

    def on_train_end(self) -> None:
        self.reward_watch.raise_pending()

    def drop_stale_completions(self) -> None:
        """At a resumed fit's start: the completions rows of the steps from ``rollout_step`` on, which this start
        logs again (a kill after the last checkpoint left them), leave ``completions.jsonl``."""
        if self.trainer.ckpt_path is not None and self.trainer.is_global_zero:
            drop_rows_from(Path(self.trainer.default_root_dir) / "completions.jsonl", self.rollout_step)

    def log_completions(self, rollout, rewards, success, parts, advantages) -> None:
        """A few groups of this step (this process's first ones), to ``completions.jsonl`` and the logger."""
        if not self.trainer.is_global_zero:
            return
        p, g = rollout.prompt_length, rollout.group_size
        trajectory = rollout.row_trajectory()  # each group's first row: its first trajectory's first row
        firsts = torch.searchsorted(trajectory, torch.arange(rollout.num_groups, device=trajectory.device) * g)
        prompts = self.tokenizer.batch_decode(rollout.input_ids[firsts, :p], skip_special_tokens=True)
        rows = completion_rows(
            self.rollout_step, rollout, prompts, rewards, success, parts, advantages, self.log_completions_groups
        )
        write_rows(rows, Path(self.trainer.default_root_dir), self.trainer.loggers, self.rollout_step)

    def _log_step(self, rollout, rewards, success, advantages, logs: dict[str, Tensor], timing: dict[str, float]):
        lengths = rollout.completion_mask.sum(-1).float()  # [N'] generated tokens of each row
        if rollout.trajectory is not None:  # ... of each trajectory
            lengths = lengths.new_zeros(len(rollout.completions)).index_add_(0, rollout.trajectory, lengths)
        advantages = advantages.float()
        add_up = lambda sums: self.trainer.strategy.reduce(sums, reduce_op="sum")  # noqa: E731
        counted = {  # (sum, count): processes may hold different numbers of groups (dynamic sampling's last round)
            "train/advantage/mean": (advantages.sum(), advantages.numel()),
            "train/advantage/abs_mean": (advantages.abs().sum(), advantages.numel()),
            "train/completion/length_mean": (lengths.sum(), lengths.numel()),
            "train/completion/truncated": (rollout.truncated.float().sum(), rollout.truncated.numel()),
        }
        counted |= self._objective(rewards) | episode_log(rollout, advantages.device)
        self.log_dict(global_means(counted, add_up))  # already over every process
        self._log_mean(
            logs
            | {
                "train/time/rollout_s": timing["rollout_s"],
                "train/time/step_s": timing["step_s"],
                "train/throughput/rollout_tok_s": lengths.sum() / max(timing["rollout_s"], 1e-9),
            }
            | nucleus_log(rollout, add_up),
            prog_bar=("train/reward", "train/success_rate"),
        )
        maxima = {"train/advantage/max": advantages.max(), "train/completion/length_max": lengths.max()}
        self.log_dict(maxima, sync_dist=True, reduce_fx="max")
        self.log("train/advantage/min", advantages.min(), sync_dist=True, reduce_fx="min")
        mass = self.trainer.strategy.reduce(budget_mass(advantages, success.float().mean(-1)), reduce_op="sum")
        self.log_dict({f"train/budget/{k}": v.float() for k, v in budget_shares(mass).items()})

    def _objective(self, rewards: Tensor) -> dict[str, tuple[Tensor, int]]:
        """``train/log_mgf``: the mean over groups of tau log mean_j exp(r_j / tau), each group's plug-in estimate of
        the log-MGF objective tau log E exp(r / tau) that SoftmaxGRPO's update approaches as G grows, not that
        objective itself (``estimators.softmax_grpo.log_mgf``, arXiv 2608.09271), at ``log_mgf_temperature``, else
        at a SoftmaxGRPO estimator's own temperature (per group under its ESS rule; not for z-scored rewards), else
        not logged. A (sum over groups, groups) pair for ``global_means``."""
        tau = self.log_mgf_temperature
        if tau is None and isinstance(self.estimator, SoftmaxGRPO) and not self.estimator.standardize:
            tau = self.estimator.group_temperatures(rewards)
        return {} if tau is None else {"train/log_mgf": (log_mgf(rewards, tau).sum(), rewards.shape[0])}

    def _log_mean(self, values: dict[str, Tensor | float], prog_bar: tuple[str, ...] = ()) -> None:
        """Each value's mean over processes. Lightning reduces each key in a collective of its own, in the order
        logged, so every process logs ``agreed_keys``: a key another process has and this one lacks (the part of a
        reward whose scoring failed here, which reports its own name only) counts 0 here."""
        world = self.trainer.world_size if self._trainer else 1
        for key in agreed_keys(values) if world > 1 else values:
            value = torch.as_tensor(values.get(key, 0.0), dtype=torch.float32, device=self.device)
            self.log(key, value, prog_bar=key in prog_bar, sync_dist=world > 1)


def global_means(pairs: dict[str, tuple[Tensor, int]], add_up=lambda sums: sums) -> dict[str, Tensor]:
    """Each key's mean over the values of every process, from ``(sum, count)`` pairs added over processes
    (``add_up``: a sum over processes, one collective) before the division: a process holding more groups or
    trajectories counts more (a mean of per-process means weighed a process with one group as one with eight). A
    key no process has a value for is 0. Every process must give the same keys."""
    keys = sorted(pairs)
    if not keys:
        return {}
    sums = torch.stack([pairs[k][0].float().reshape(()) for k in keys])  # on the values' device
    total = add_up(torch.cat([sums, sums.new_tensor([float(pairs[k][1]) for k in keys])]))
    return dict(zip(keys, total[: len(keys)] / total[len(keys) :].clamp_min(1)))


def agreed_keys(values: dict) -> list[str]:
    """The keys of ``values`` on every process, sorted (one object all-gather over the default process group).

    Without it a process whose keys differed (a reward failing there alone: its parts ``{name: zeros}``, not the
    parts the others report) logged one collective more or fewer than the others: every later metric was reduced
    with another's value, then a reduction met a tensor of another size (gloo aborts; NCCL reads past it or
    hangs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sorted(values)
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(values))
    return sorted(set().union(*gathered))


def nucleus_log(rollout, add_up=lambda sums: sums) -> dict[str, Tensor]:
    """``train/rollout/nucleus_mass``: the mean over sampled tokens of the mass top-p kept (the full softmax's mass
    on the nucleus the token was drawn from; 1 without top-p), where the engine reports it (the lean decoder; the
    same engine on every process), over every process's tokens (``add_up`` sums a tensor over processes)."""
    if rollout.nucleus_mass is None:
        return {}
    mask = rollout.completion_mask.float()
    mass, tokens = add_up(torch.stack([(rollout.nucleus_mass * mask).sum(), mask.sum()]))
    return {"train/rollout/nucleus_mass": mass / tokens.clamp_min(1.0)}


def episode_log(rollout, device: torch.device | str = "cpu") -> dict[str, tuple[Tensor, int]]:
    """Multi-turn episodes' quantities (``sgrpo.types.Episode``) as (sum on ``device``, episodes) pairs for
    ``global_means``, whose means are over every process's episodes: ``train/episode/turns``, ``tool_calls``,
    ``tool_failures``, ``tool_use_rate`` (the share of episodes with a tool call), ``tokens/generated`` and
    ``tokens/observation`` (tokens after the opening by role), ``forks`` (rows started where the chat template broke
    the prefix) and ``env_reward`` (the environment's per-turn rewards, summed per episode); nothing without
    episodes. Processes may hold different numbers of episodes (dynamic sampling's last round): a mean of each
    process's means weighed one episode as much as eight."""
    if rollout.episodes is None:
        return {}
    values = episode_values(rollout.episodes)
    return {f"train/episode/{name}": (torch.tensor(sum(v), dtype=torch.float32, device=device), len(v))
            for name, v in values.items()}  # fmt: skip
