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
    """G sampled completions for each of B prompts; trajectory ``b * G + g`` is completion g of prompt b.

    N = B * G trajectories; P = prompt length (left-padded), T = completion length (right-padded). Single-turn:
    row i is trajectory i (``trajectory`` None). Multi-turn (``sgrpo.rollout.episodes``): a row's completion
    region holds the model's turns (``completion_mask`` 1: the loss mask, generated tokens only) and the
    observations between them (attended, mask 0, log-prob 0); an episode whose chat template stopped extending
    its tokens continues in a new row, so N' >= N rows, ``trajectory`` ``[N']`` naming each row's trajectory
    (rows of a trajectory are consecutive, in order). ``completions``, ``truncated`` and ``episodes`` are per
    trajectory; every ``[N', ...]`` tensor per row (``per_row`` maps per-trajectory values to rows).
    """

    input_ids: Tensor  # [N', P + T] long: prompt tokens then completion tokens
    attention_mask: Tensor  # [N', P + T] long: 1 on real tokens (prompt, completion, observations)
    completion_mask: Tensor  # [N', T] bool: generated tokens, up to and including EOS (the loss mask)
    completions: list[str]  # N decoded completions (an episode's final assistant message), special tokens removed
    truncated: Tensor  # [N] bool: stopped by max_new_tokens before EOS (an episode: by a token limit)
    group_size: int  # G
    logprobs: Tensor | None = None  # [N', T] float32 sampling log-probs, 0 on padding (engines that have them)
    nucleus_mass: Tensor | None = None  # [N', T] float32 the mass top-p kept for each token, 0 on padding (ditto)
    versions: Tensor | None = None  # [N'] long: the training step whose weights sampled each row (async rollouts)
    trajectory: Tensor | None = None  # [N'] long: each row's trajectory; None: row i is trajectory i
    episodes: list[Episode] | None = None  # N multi-turn episodes (None: single-turn)
    #: [N'] long: the newest version that sampled a token of each row's group, where a group's sampling spanned
    #: weight pushes (vLLM servers paused with requests kept); ``versions`` stays the oldest (staleness counts from it)
    newest_versions: Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    @property
    def num_groups(self) -> int:
        return len(self.completions) // self.group_size

    def row_trajectory(self) -> Tensor:
        """``[N']`` long: each row's trajectory."""
        if self.trajectory is not None:
            return self.trajectory
        return torch.arange(self.input_ids.shape[0], device=self.input_ids.device)

    def per_row(self, values: Tensor) -> Tensor:
        """Per-trajectory ``values`` ``[N, ...]`` as per-row ``[N', ...]`` (the same tensor when single-turn)."""
        return values if self.trajectory is None else values[self.trajectory.to(values.device)]

    def __post_init__(self) -> None:
        n, total = self.input_ids.shape
        t = self.completion_mask.shape[1]
        trajectories = len(self.completions)
        if self.group_size < 1 or trajectories % self.group_size:
            raise ValueError(f"trajectories ({trajectories}) must be a multiple of group_size ({self.group_size})")
        if (n != trajectories) if self.trajectory is None else (self.trajectory.shape != (n,)):
            raise ValueError(f"{n} rows for {trajectories} trajectories need a trajectory index [{n}]")
        if self.episodes is not None and len(self.episodes) != trajectories:
            raise ValueError(f"need {trajectories} episodes, got {len(self.episodes)}")
        bad_logprobs = any(x is not None and x.shape != (n, t) for x in (self.logprobs, self.nucleus_mass))
        if self.attention_mask.shape != (n, total) or bad_logprobs or t > total:
            raise ValueError(
                f"inconsistent RolloutBatch shapes: input_ids {tuple(self.input_ids.shape)}, attention_mask "
                f"{tuple(self.attention_mask.shape)}, completion_mask {tuple(self.completion_mask.shape)}, "
                f"logprobs {None if self.logprobs is None else tuple(self.logprobs.shape)}"
            )
        if self.versions is not None and self.versions.shape != (n,):
            raise ValueError(f"versions must be [{n}] (one per row), got {tuple(self.versions.shape)}")
        if self.newest_versions is not None and (self.versions is None or self.newest_versions.shape != (n,)):
            raise ValueError(f"newest_versions must be [{n}] (one per row) and come with versions")
        if self.truncated.shape != (trajectories,):
            raise ValueError(f"need {trajectories} truncated flags, got {tuple(self.truncated.shape)}")

    def select_groups(self, groups: Tensor) -> RolloutBatch:
        """The rows of groups ``groups`` ``[K]`` (indices), in that order."""
        g = self.group_size
        chosen = (groups.unsqueeze(-1) * g + torch.arange(g, device=groups.device)).reshape(-1)  # [K * G]
        rows, trajectory = chosen, None
        if self.trajectory is not None:  # each chosen trajectory's rows, renumbered in the new order
            own = self.trajectory.to(chosen.device)
            matches = (own.unsqueeze(0) == chosen.unsqueeze(-1)).long()  # [K * G, N']
            rows = matches.nonzero()[:, 1]  # row-major: trajectories in the chosen order, their rows in order
            trajectory = matches.nonzero()[:, 0].to(self.trajectory.device)
        rows_on = rows.to(self.input_ids.device)
        return RolloutBatch(
            input_ids=self.input_ids[rows_on],
            attention_mask=self.attention_mask[rows_on],
            completion_mask=self.completion_mask[rows_on],
            completions=[self.completions[i] for i in chosen.tolist()],
            truncated=self.truncated[chosen.to(self.truncated.device)],
            group_size=g,
            logprobs=None if self.logprobs is None else self.logprobs[rows_on],
            nucleus_mass=None if self.nucleus_mass is None else self.nucleus_mass[rows_on],
            versions=None if self.versions is None else self.versions[rows_on.to(self.versions.device)],
            trajectory=trajectory,
            episodes=None if self.episodes is None else [self.episodes[i] for i in chosen.tolist()],
            newest_versions=None if self.newest_versions is None else self.newest_versions[rows_on.to(
                self.newest_versions.device)],
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
            trajectory=_joined_trajectories(batches),
            episodes=None if any(b.episodes is None for b in batches) else [e for b in batches for e in b.episodes],
            newest_versions=None if any(b.newest_versions is None for b in batches) else torch.cat(
                [b.newest_versions for b in batches]),
        )


def _joined_trajectories(batches: Sequence[RolloutBatch]) -> Tensor | None:
    """The row -> trajectory index of ``RolloutBatch.cat``'s result (None when no batch has one)."""
    if all(b.trajectory is None for b in batches):
        return None
    offsets = [0]
    for b in batches[:-1]:
        offsets.append(offsets[-1] + len(b.completions))
    return torch.cat([b.row_trajectory() + offset for b, offset in zip(batches, offsets)])


@dataclass(frozen=True)
class Episode:
    """One multi-turn episode (``tasks.environment``): its conversation and counts, for logs and rewards.

    ``messages``: the whole conversation (opening, model turns, observations); ``rewards``: the environment's
    per-turn rewards (None where a turn had none); ``turns``: model turns; ``tool_calls`` / ``tool_failures``;
    ``generated_tokens`` / ``observation_tokens``: tokens after the opening by role; ``forks``: rows started
    because the chat template did not extend the previous tokens (the trajectory has ``forks + 1`` rows).
    """

    messages: Messages
    rewards: list[float | None] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    forks: int = 0

    @property
    def reward(self) -> float:
        """The sum of the per-turn rewards (0 without any), added to the task's reward of the episode."""
        return float(sum(r for r in self.rewards if r is not None))
