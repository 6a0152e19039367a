"""Test doubles for the engine: a task with preset rewards and a rollout engine that replays a fixed batch."""

from __future__ import annotations

import tempfile

import torch
from lightning.pytorch import Trainer

from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout, RolloutEngine
from sgrpo.types import Example, RolloutBatch
from tasks.base import Reward, RewardResult, Task

EXAMPLES = [
    Example(prompt=f"s:{d}=", answer="".join(sorted(str(d))), difficulty=len(str(d)))
    for d in (31, 402, 9175, 56, 803, 4127, 77, 210)
]


class PresetReward(Reward):
    """Reward = a preset value per example id and group position (rows b*G+g of the fixed batch)."""

    name = "preset"

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table
        self._seen: dict[str, int] = {}

    def score(self, examples, completions) -> RewardResult:
        values, cursor = [], {}
        for ex in examples:
            g = cursor.get(ex.prompt, 0)
            cursor[ex.prompt] = g + 1
            values.append(self.table[ex.prompt][g])
        total = torch.tensor(values, dtype=torch.float32)
        return RewardResult(total, {self.name: total})


class FixedTask(Task):
    def __init__(self, reward: Reward, examples=EXAMPLES) -> None:
        super().__init__(reward)
        self._examples = list(examples)

    def load(self, split):
        return self._examples

    def success(self, example, completion) -> bool:
        return completion.strip() == example.answer


class FixedRollout(RolloutEngine):
    """Replays the rows of a fixed global rollout batch for whichever prompts it is asked about."""

    def __init__(self, batch: RolloutBatch, prompts: list[str], max_new_tokens: int, temperature: float = 1.0):
        self.batch, self.prompts = batch, prompts
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def generate(self, model, tokenizer, examples, group_size, greedy=False) -> RolloutBatch:
        g = self.batch.group_size
        rows = torch.tensor([self.prompts.index(ex.prompt) * g + j for ex in examples for j in range(g)])
        b = self.batch
        return RolloutBatch(
            b.input_ids[rows],
            b.attention_mask[rows],
            b.completion_mask[rows],
            [b.completions[i] for i in rows.tolist()],
            b.truncated[rows],
            g,
        )


def fixed_batch(model_dir, examples=EXAMPLES, group_size=4, max_new_tokens=6, seed=0) -> RolloutBatch:
    """Sample a rollout batch once from the tiny model, deterministically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return HFRollout(max_new_tokens=max_new_tokens).generate(model, tokenizer, examples, group_size)


class GradCapture(GRPOPolicy):
    """Records the gradients seen by each optimiser step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.captured: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.captured.append(
            {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        )
        super().on_before_optimizer_step(optimizer)  # the policy's own norm and clip


def run_steps(policy: GRPOPolicy, steps: int = 1, root=None, **trainer_kwargs) -> Trainer:
    kwargs = dict(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root or tempfile.mkdtemp(prefix="sgrpo-test-"),  # the HF export lands there
    )
    trainer = Trainer(**(kwargs | trainer_kwargs))
    trainer.fit(policy)
    return trainer

