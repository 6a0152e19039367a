"""Evaluation of the policy: validation during a fit, and validation or test on their own (``sgrpo.fit validate|test``).

``PolicyEvaluation`` is mixed into ``GRPOPolicy``. Each prompt of the split gets ``val_samples`` completions
from ``val_rollout`` (greedy with ``val_greedy``), seeded from (seed, batch, rank), and the task's success
test grades them; the results of every process are gathered at the epoch's end and logged under ``val/``
or ``test/``: ``pass@k`` for k = 1..n (unbiased estimator), ``accuracy``, ``accuracy/<difficulty>``,
``pass@k/<difficulty>`` and ``successes/<c>`` (the share of prompts with c of n samples right).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sgrpo.data import mix_seed, prompt_collate
from sgrpo.metrics import accuracy_by_difficulty, pass_at_k, pass_at_k_by_difficulty, success_count_histogram
from sgrpo.types import Example

#: the metric prefix and the seed salt of each evaluated split
SPLITS = {"validation": ("val", 7), "test": ("test", 8)}


class PolicyEvaluation:
    """Validation and test steps; ``last_evaluation`` holds the latest result, ``val_history`` every validation."""

    val_history: list[dict[str, Any]]
    last_evaluation: dict[str, Any] | None

    def val_dataloader(self):
        return self._evaluation_loader("validation")

    def test_dataloader(self):
        return self._evaluation_loader("test")

    def _evaluation_loader(self, split: str):
        """Batches of (index in the split, example). Over several processes Lightning's ``DistributedSampler``
        hands each as many prompts by repeating the first ones (under FSDP2 every process must run as many
        rollouts); the index lets ``_evaluation_end`` count each prompt once."""
        examples, _ = self._within_prompt_limit(split)
        indexed = list(enumerate(examples))
        return torch.utils.data.DataLoader(indexed, batch_size=self.val_prompts_per_batch, collate_fn=prompt_collate)

    def validation_step(self, batch: list[tuple[int, Example]], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "validation")

    def test_step(self, batch: list[tuple[int, Example]], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_validation_epoch_end(self) -> None:
        result = self._evaluation_end("validation")
        if result is not None:
            self.val_history.append(result)

    def on_test_epoch_end(self) -> None:
        self._evaluation_end("test")

    def _evaluate(self, batch: list[tuple[int, Example]], batch_idx: int, split: str) -> None:
        examples = [example for _, example in batch]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, batch_idx, self.global_rank, SPLITS[split][1]))
            rollout = self.val_rollout.generate(
                self.model, self.tokenizer, examples, self.val_samples, greedy=self.val_greedy
            )
        repeated = [ex for ex in examples for _ in range(self.val_samples)]
        with torch.device("cpu"):  # host tensors from the task, as in `score`
            correct = self.task.successes(repeated, rollout.completions).view(len(examples), self.val_samples)
        self._val_outputs.append(([i for i, _ in batch], correct.cpu(), [ex.difficulty for ex in examples]))

    def _evaluation_end(self, split: str) -> dict[str, Any] | None:
        """Gather every process's results, log them, and return them (None in the sanity check)."""
        outputs: list[tuple[list[int], Tensor, list[object]]]
        outputs, self._val_outputs = self._val_outputs, []
        if self.trainer.world_size > 1:
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, outputs)
            outputs = [o for part in gathered for o in part]
        if not outputs or self.trainer.sanity_checking:
            return None
        first: dict[int, tuple[Tensor, object]] = {}  # each prompt once: the sampler repeats some across processes
        for indices, correct, levels in outputs:
            for index, row, level in zip(indices, correct, levels, strict=True):
                first.setdefault(index, (row, level))
        correct = torch.stack([row for row, _ in first.values()])  # [prompts, n]
        levels = [level for _, level in first.values()]
        solved, n = correct.sum(-1), self.val_samples
        passes = {k: pass_at_k(solved, n, k).mean().item() for k in range(1, n + 1)}
        result = {
            "step": self.rollout_step,
            "accuracy": correct.float().mean().item(),
            "by_difficulty": accuracy_by_difficulty(correct, levels),
            "pass_at_k": passes,
            "prompts": len(correct),
        }
        prefix = SPLITS[split][0]
        metrics = {f"{prefix}/pass@{k}": value for k, value in passes.items()}
        metrics[f"{prefix}/accuracy"] = result["accuracy"]
        metrics |= {f"{prefix}/accuracy/{level}": acc for level, acc in result["by_difficulty"].items()}
        for level, by_k in pass_at_k_by_difficulty(correct, levels).items():
            metrics |= {f"{prefix}/pass@{k}/{level}": value for k, value in by_k.items()}
        metrics |= {f"{prefix}/successes/{c}": share for c, share in enumerate(success_count_histogram(correct))}
        self.log_dict(metrics, prog_bar=False, rank_zero_only=True)
        self.last_evaluation = result | {"split": split}
        return result


def evaluation_table(result: dict[str, Any]) -> str:
    """Markdown table of one evaluation's accuracy per difficulty, then pass@k."""
    levels = result["by_difficulty"]
    lines = ["| difficulty | accuracy |", "|---|---|"]
    lines += [f"| {level} | {accuracy:.1%} |" for level, accuracy in levels.items()]
    lines.append(f"| mean over levels | {sum(levels.values()) / len(levels):.1%} |")
    passes = ", ".join(f"pass@{k} {value:.1%}" for k, value in result["pass_at_k"].items())
    n = len(result["pass_at_k"])
    return "\n".join(lines) + f"\n\n{passes} ({result['prompts']} prompts, {n} sample{'s' * (n != 1)} each)"
