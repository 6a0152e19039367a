"""The typed objects that cross module boundaries: one prompt (``Example``) and one rollout batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: a chat prompt: [{"role": "system" | "user" | "assistant", "content": str}, ...]
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One prompt of a task.

    ``prompt`` is raw text (fed to the model as is) or chat messages (rendered with the tokenizer's
    chat template, or a plain template when it has none). ``answer`` is the reference the reward and
    the success test compare against. ``difficulty`` drives per-difficulty metrics (DeepMath's
    AoPS rating, a synthetic task's level); ``metadata`` carries anything else (topic, id, ...).
    ``chat_template_kwargs`` go to the chat template with the messages (Qwen3's ``enable_thinking``).
    """

    prompt: str | Messages
    answer: str
    difficulty: float | int | str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutBatch:
    """G sampled completions for each of B prompts; row ``b * G + g`` is completion g of prompt b.

    N = B * G rows; P = prompt length (left-padded), T = completion length (right-padded).
    """

    input_ids: Tensor  # [N, P + T] long: prompt tokens then completion tokens
    attention_mask: Tensor  # [N, P + T] long: 1 on real tokens (prompt and completion)
    completion_mask: Tensor  # [N, T] bool: generated tokens, up to and including EOS
    completions: list[str]  # N decoded completions, special tokens removed
    truncated: Tensor  # [N] bool: stopped by max_new_tokens before EOS
    group_size: int  # G
    logprobs: Tensor | None = None  # [N, T] float32 sampling log-probs, 0 on padding (engines that have them)
    nucleus_mass: Tensor | None = None  # [N, T] float32 the mass top-p kept for each token, 0 on padding (ditto)
    versions: Tensor | None = None  # [N] long: the training step whose weights sampled each row (async rollouts)

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    @property
    def num_groups(self) -> int:
        return self.input_ids.shape[0] // self.group_size

    def __post_init__(self) -> None:
        n, total = self.input_ids.shape
        t = self.completion_mask.shape[1]
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"rows ({n}) must be a multiple of group_size ({self.group_size})")
        bad_logprobs = any(x is not None and x.shape != (n, t) for x in (self.logprobs, self.nucleus_mass))
        if self.attention_mask.shape != (n, total) or bad_logprobs or t > total:
            raise ValueError(
                f"inconsistent RolloutBatch shapes: input_ids {tuple(self.input_ids.shape)}, attention_mask "
                f"{tuple(self.attention_mask.shape)}, completion_mask {tuple(self.completion_mask.shape)}, "
                f"logprobs {None if self.logprobs is None else tuple(self.logprobs.shape)}"
            )
        if self.versions is not None and self.versions.shape != (n,):
            raise ValueError(f"versions must be [{n}] (one per row), got {tuple(self.versions.shape)}")
        if len(self.completions) != n or self.truncated.shape != (n,):
            raise ValueError(f"need {n} completions and truncated flags, got {len(self.completions)}")

    def select_groups(self, groups: Tensor) -> RolloutBatch:
        """The rows of groups ``groups`` ``[K]`` (indices), in that order."""
        g = self.group_size
        rows = (groups.unsqueeze(-1) * g + torch.arange(g, device=groups.device)).reshape(-1)  # [K * G]
        return RolloutBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            completion_mask=self.completion_mask[rows],
            completions=[self.completions[i] for i in rows.tolist()],
            truncated=self.truncated[rows],
            group_size=g,
            logprobs=None if self.logprobs is None else self.logprobs[rows],
            nucleus_mass=None if self.nucleus_mass is None else self.nucleus_mass[rows],
            versions=None if self.versions is None else self.versions[rows],
        )

    @staticmethod
    def cat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Batches of one group size as one: prompts left-padded, completions right-padded to the longest.

        Padding positions hold token 0 with attention 0 (never attended, never in the loss).
        """
        p = max(b.prompt_length for b in batches)
        t = max(b.completion_mask.shape[1] for b in batches)

        def right(x: Tensor) -> Tensor:  # [N, T_b] -> [N, T]
            return F.pad(x, (0, t - x.shape[1]))

        def pad(x: Tensor, b: RolloutBatch) -> Tensor:  # [N, P_b + T_b] -> [N, P + T]
            prompt, completion = x[:, : b.prompt_length], x[:, b.prompt_length :]
            return torch.cat([F.pad(prompt, (p - prompt.shape[1], 0)), right(completion)], 1)

        def per_token(name: str) -> Tensor | None:  # an optional [N, T] field: kept when every batch has it
            values = [getattr(b, name) for b in batches]
            return None if any(v is None for v in values) else torch.cat([right(v) for v in values])

        return RolloutBatch(
            input_ids=torch.cat([pad(b.input_ids, b) for b in batches]),
            attention_mask=torch.cat([pad(b.attention_mask, b) for b in batches]),
            completion_mask=torch.cat([right(b.completion_mask) for b in batches]),
            completions=[c for b in batches for c in b.completions],
            truncated=torch.cat([b.truncated for b in batches]),
            group_size=batches[0].group_size,
            logprobs=per_token("logprobs"),
            nucleus_mass=per_token("nucleus_mass"),
            versions=None if any(b.versions is None for b in batches) else torch.cat([b.versions for b in batches]),
        )
