"""Evaluation of the policy: validation during a fit, and validation or test on their own (``sgrpo.fit validate|test``).

``PolicyEvaluation`` is mixed into ``GRPOPolicy``. Each prompt of the split gets ``val_samples`` completions
from ``val_rollout`` (greedy with ``val_greedy``), seeded from (seed, batch, rank), and the task's success
test grades them. The split holds one or several evaluation sets (``Task.evaluation_set``: Polaris evaluates
AIME 2025 and MATH-500), each with its own torchmetrics metrics (``sgrpo.eval.metrics``), which sync over the
processes at the epoch's end (each prompt counted once) and are logged under ``val/`` or ``test/`` for a split
of one set, ``val/<set>/`` for each of several: ``pass@k`` for k = 1..n (unbiased estimator), ``accuracy``,
``accuracy/<difficulty>``, ``pass@k/<difficulty>`` and ``successes/<c>`` (the share of prompts with c of n
samples right); with ``val_reward`` also ``reward``, the mean training reward of the completions (``MeanReward``).
With an environment (multi-turn episodes) also ``val/episode/<quantity>`` (``EPISODE_METRICS``: turns, tool calls,
tool failures, forks, tokens by role, ``tool_use_rate``, ``env_reward``): each one's mean over the episodes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sgrpo.checks import require
from sgrpo.eval.metrics import EPISODE_METRICS, SET_METRICS, MeanReward, PromptOutcomes, episode_values
from sgrpo.eval.passk import rows_by_difficulty
from sgrpo.run.data import mix_seed, prompt_collate
from sgrpo.types import Example

#: the metric prefix and the seed salt of each evaluated split
SPLITS = {"validation": ("val", 7), "test": ("test", 8)}


class PolicyEvaluation:
    """Validation and test steps; ``last_evaluation`` holds the latest result, ``val_history`` every validation.

    A result is ``{"step", "accuracy", "by_difficulty", "pass_at_k", "prompts"}`` for a split of one set, and
    ``{"step", "sets": {name: {"accuracy", ...}}}`` for several (``result_sets`` reads both).
    """

    val_history: list[dict[str, Any]]
    last_evaluation: dict[str, Any] | None
    _evaluation_metrics: dict[str, dict[str, PromptOutcomes]]  # set -> its metrics (SET_METRICS)
    _evaluation_rewards: dict[str, MeanReward]  # set -> its mean reward (with val_reward)
    _evaluation_rows: list[tuple[str, int]]  # per index of the split: its set and its level's index there

    def val_dataloader(self):
        return self._evaluation_loader("validation")

    def test_dataloader(self):
        return self._evaluation_loader("test")

    def _evaluation_loader(self, split: str):
        """Batches of (index in the split, example). Over several processes Lightning's ``DistributedSampler``
        hands each as many prompts by repeating the first ones (under FSDP2 every process must run as many
        rollouts); the index lets the metrics count each prompt once. Builds each set's metrics, with the
        set's difficulty labels, on this process's device."""
        examples, _ = self._within_prompt_limit(split)
        names = [self.task.evaluation_set(ex) for ex in examples]
        require(all(isinstance(n, str) and "/" not in n for n in names),
                "Task.evaluation_set must give a name without '/' (or '' for one set)")  # fmt: skip
        sets: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            sets.setdefault(name, []).append(index)
        require("" not in sets or len(sets) == 1, "Task.evaluation_set must name every set when it names one")
        device = self.trainer.strategy.root_device
        self._evaluation_metrics, self._evaluation_rows = {}, [("", 0)] * len(examples)
        for name, indices in sets.items():
            levels = rows_by_difficulty([examples[i].difficulty for i in indices], len(indices))
            for position, rows in enumerate(levels.values()):
                for row in rows:
                    self._evaluation_rows[indices[row]] = (name, position)
            self._evaluation_metrics[name] = {
                key: metric(self.val_samples, list(levels)).to(device) for key, metric in SET_METRICS.items()
            }
        self._evaluation_rewards = {name: MeanReward(self.val_samples).to(device) for name in sets if self.val_reward}
        episodes = getattr(self, "environment", None) is not None  # val/episode/*: each quantity's mean per episode
        self._evaluation_episodes = {k: MeanReward(self.val_samples).to(device) for k in EPISODE_METRICS if episodes}
        indexed = list(enumerate(examples))
        return torch.utils.data.DataLoader(indexed, batch_size=self.val_prompts_per_batch, collate_fn=prompt_collate)

    def validation_step(self, batch: list[tuple[int, Example]], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "validation")

    def test_step(self, batch: list[tuple[int, Example]], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_validation_epoch_start(self) -> None:
        self.val_rollout.hold()  # the weights do not change during a validation: vLLM stays awake, synced once

    def on_test_epoch_start(self) -> None:
        self.val_rollout.hold()

    def on_validation_epoch_end(self) -> None:
        self.val_rollout.release()
        result = self._evaluation_end("validation")
        if result is not None:  # a step validated again (a resume from a save made as its metrics were logged): once
            self.val_history[:] = [entry for entry in self.val_history if entry["step"] != result["step"]]
            self.val_history.append(result)

    def on_test_epoch_end(self) -> None:
        self.val_rollout.release()
        self._evaluation_end("test")

    def _evaluate(self, batch: list[tuple[int, Example]], batch_idx: int, split: str) -> None:
        examples = [example for _, example in batch]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, batch_idx, self.global_rank, SPLITS[split][1]))
            rollout = self.generate_with(self.val_rollout, examples, self.val_samples, greedy=self.val_greedy)
        repeated = [ex for ex in examples for _ in range(self.val_samples)]
        with torch.device("cpu"):  # host tensors from the task, as in `score`
            rewards = None
            if self.val_reward:  # the training reward of every completion (the environment's turns' too), as trained
                scored = self.task.score(repeated, rollout.completions)  # and success: one grading where they agree
                correct, rewards = scored.success, scored.total.view(len(examples), -1)
                if rollout.episodes is not None:
                    turns = torch.tensor([e.reward for e in rollout.episodes], dtype=rewards.dtype, device="cpu")
                    rewards = rewards + turns.view_as(rewards)
            else:
                correct = self.task.successes(repeated, rollout.completions)
            correct = correct.view(len(examples), self.val_samples)
        index = torch.tensor([i for i, _ in batch], dtype=torch.long, device="cpu")
        if rollout.episodes is not None:
            for key, values in episode_values(rollout.episodes).items():
                per_prompt = torch.tensor(values, dtype=torch.float64, device="cpu").view(len(examples), -1)
                self._evaluation_episodes[key].update(index, per_prompt)
        placed = [self._evaluation_rows[i] for i, _ in batch]
        for name, metrics in self._evaluation_metrics.items():
            rows = [row for row, (set_name, _) in enumerate(placed) if set_name == name]
            if rows:
                level = torch.tensor([placed[row][1] for row in rows], dtype=torch.long, device="cpu")
                for metric in metrics.values():
                    metric.update(index[rows], correct.cpu()[rows], level)
                if rewards is not None:
                    self._evaluation_rewards[name].update(index[rows], rewards[rows])

    def _evaluation_end(self, split: str) -> dict[str, Any] | None:
        """Compute every set's metrics (synced over the processes: every process computes them), log them, and
        return the result (None in the sanity check, or when no prompt was evaluated)."""
        sets: dict[str, dict[str, Any]] = {}
        metrics: dict[str, float] = {}
        for name, set_metrics in self._evaluation_metrics.items():
            mean_reward = getattr(self, "_evaluation_rewards", {}).get(name)
            if self.trainer.sanity_checking:
                for metric in [*set_metrics.values(), *([mean_reward] if mean_reward is not None else [])]:
                    metric.reset()
                continue
            values = {key: computed(metric, self.val_samples) for key, metric in set_metrics.items()}
            levels = set_metrics["by_difficulty"].levels
            # torchmetrics hands back a one-element result as a scalar (one level, or one sample)
            values["pass_at_k_by_difficulty"] = values["pass_at_k_by_difficulty"].reshape(len(levels), -1)
            values |= {key: values[key].reshape(-1) for key in ("pass_at_k", "by_difficulty", "successes")}
            prompts = int(values["successes"].sum())
            if prompts == 0:  # none of this set's prompts was evaluated (limit_val_batches)
                if mean_reward is not None:
                    mean_reward.reset()
                continue
            present = [i for i, acc in enumerate(values["by_difficulty"].tolist()) if not math.isnan(acc)]
            passes = {k: value for k, value in enumerate(values["pass_at_k"].tolist(), start=1)}
            sets[name] = {
                "accuracy": values["accuracy"].item(),
                "by_difficulty": {levels[i]: values["by_difficulty"][i].item() for i in present},
                "pass_at_k": passes,
                "prompts": prompts,
            }
            prefix = f"{SPLITS[split][0]}/{name}/" if name else f"{SPLITS[split][0]}/"
            if mean_reward is not None:
                sets[name]["reward"] = computed(mean_reward, self.val_samples).item()
                metrics[f"{prefix}reward"] = sets[name]["reward"]
            metrics |= {f"{prefix}pass@{k}": value for k, value in passes.items()}
            metrics[f"{prefix}accuracy"] = sets[name]["accuracy"]
            metrics |= {f"{prefix}accuracy/{level}": acc for level, acc in sets[name]["by_difficulty"].items()}
            for i in present:
                by_k = values["pass_at_k_by_difficulty"][i].tolist()
                metrics |= {f"{prefix}pass@{k}/{levels[i]}": value for k, value in enumerate(by_k, start=1)}
            shares = (values["successes"] / prompts).tolist()
            metrics |= {f"{prefix}successes/{c}": share for c, share in enumerate(shares)}
        for key, metric in getattr(self, "_evaluation_episodes", {}).items():  # every process: the sync's collective
            if sets:
                metrics[f"{SPLITS[split][0]}/episode/{key}"] = metric.compute().item()
            metric.reset()
        if not sets:
            return None
        dropped = self._within_prompt_limit(split)[1]  # over the prompt limit: not in any set's accuracy or pass@k
        metrics[f"{SPLITS[split][0]}/prompts_dropped"] = float(dropped)
        # logged at the count of training steps of the weights scored, Lightning's "step" metric: its own step is one
        # less inside a fit (--validate_before's and the first step's validations both fell at 0) and 0 in validate.
        # The value stays in callback_metrics: sgrpo.run.saving.RunCheckpoint names checkpoints by global_step
        self.log_dict(metrics | {"step": float(self.rollout_step)}, prog_bar=False, rank_zero_only=True)
        result = {"step": self.rollout_step, "prompts_dropped": dropped} | sets.get("", {"sets": sets})
        self.last_evaluation = result | {"split": split}
        return result


def computed(metric: PromptOutcomes | MeanReward, samples: int) -> torch.Tensor:
    """``metric.compute()`` (synced over the processes), then reset: each validation of a fit counts its own rows
    (Lightning builds the validation loader, and these metrics, once per fit). A process that evaluated none of the
    set's prompts first adds an empty update, so that it syncs like the others (and torchmetrics does not warn)."""
    if not metric.update_called:
        empty = torch.zeros(0, dtype=torch.long, device="cpu")
        rows = torch.zeros(0, samples, dtype=torch.bool, device="cpu")
        if isinstance(metric, MeanReward):
            metric.update(empty, rows)
        else:
            metric.update(empty, rows, empty)
    value = metric.compute()
    metric.reset()
    return value.cpu()


def result_sets(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An evaluation result's sets by name: ``{"": result}`` for a split of one set."""
    return result.get("sets", {"": result})


def evaluation_table(result: dict[str, Any]) -> str:
    """Markdown tables of one evaluation, one per evaluation set (titled by its name): accuracy per difficulty,
    then pass@k."""
    tables = []
    for name, one in result_sets(result).items():
        levels = one["by_difficulty"]
        lines = [name] if name else []
        lines += ["| difficulty | accuracy |", "|---|---|"]
        lines += [f"| {level} | {accuracy:.1%} |" for level, accuracy in levels.items()]
        lines.append(f"| mean over levels | {sum(levels.values()) / len(levels):.1%} |")
        passes = ", ".join(f"pass@{k} {value:.1%}" for k, value in one["pass_at_k"].items())
        n = len(one["pass_at_k"])
        tables.append("\n".join(lines) + f"\n\n{passes} ({one['prompts']} prompts, {n} sample{'s' * (n != 1)} each)")
    return "\n\n".join(tables)
