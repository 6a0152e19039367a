"""The reward interface: rewards score completions and never crash a run.

A ``Reward`` scores N completions (``examples[i]`` is the prompt of ``completions[i]``; the caller
repeats each example G times) and never crashes a run: a scoring call that raises or times out, or a
reward that is not finite, is scored as a wrong answer and counted in ``RewardResult.failures``.
``SampleReward`` scores one completion at a time (in worker processes with a timeout, if asked);
``WeightedSum`` adds rewards up, keeping each as a named part.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.pool import get_pool

log = logging.getLogger(__name__)

#: affine maps of a raw score in [0, 1]: "01" keeps it, "pm1" maps {0, 1} to {-1, +1} (2r - 1)
Scale = Literal["01", "pm1"]


@dataclass(frozen=True)
class RewardResult:
    """Rewards of N completions, with each component and the count of failed scorings."""

    total: Tensor  # [N] float32: the training reward
    parts: dict[str, Tensor]  # name -> [N] float32: each reward function's own (unweighted) value
    failures: int = 0  # scorings that raised or timed out and were scored as wrong
    counts: dict[str, int] = field(default_factory=dict)  # labelled outcomes, e.g. "no_box" -> 3, "timeout" -> 1
    success: Tensor | None = None  # [N] bool: the success test's verdicts, when they came from this grading

    def __post_init__(self) -> None:
        if self.total.dim() != 1 or self.total.dtype != torch.float32:
            raise ValueError(f"total must be a 1-D float32 tensor, got {self.total.dtype} {tuple(self.total.shape)}")
        for name, part in self.parts.items():
            if part.shape != self.total.shape:
                raise ValueError(f"part {name!r} has shape {tuple(part.shape)}, total {tuple(self.total.shape)}")
        if self.success is not None and (self.success.shape != self.total.shape or self.success.dtype != torch.bool):
            raise ValueError(f"success must be a bool tensor shaped like total, got {self.success.dtype} "
                             f"{tuple(self.success.shape)}")  # fmt: skip


class Reward(ABC):
    """A reward function: ``score(examples, completions)`` -> ``RewardResult``; calling it gives the total.

    Every subclass's ``score`` is protected, whoever calls it: a call that raises (``sys.exit`` included)
    scores 0 for each completion and counts them all as failures (labelled "error"); a total that is NaN or
    infinite scores 0 and is counted. A result that is not a ``RewardResult`` of one reward per completion
    raises, naming the reward and both lengths: that is a bug in the reward, not a failed scoring.
    """

    name: str = "reward"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        score = cls.__dict__.get("score")
        if score is not None and not (getattr(score, "__isabstractmethod__", False) or hasattr(score, "protected")):
            cls.score = _protected(score)

    @abstractmethod
    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> RewardResult:
        """Score ``completions[i]`` as an answer to ``examples[i]``."""

    def __call__(self, examples: Sequence[Example], completions: Sequence[str]) -> Tensor:
        """The training reward, ``[N]`` float32."""
        return self.score(examples, completions).total

    def adapt_to_tokenizer(self, tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:  # noqa: B027
        """Settle the settings that depend on the policy's tokenizer: its chat template, as the task renders its
        prompts with it (with ``chat_template_kwargs``). A hook: by default nothing."""

    def __repr__(self) -> str:
        return settings_repr(self)


def settings_repr(obj: object) -> str:
    """``Type(setting=value, ...)`` of ``obj``'s public attributes: the repr of an object built from a config."""
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(obj).items() if not k.startswith("_"))
    return f"{type(obj).__name__}({fields})"


def check_batch(examples: Sequence[Example], completions: Sequence[str]) -> None:
    """Raise if the batch is not one completion (a ``str``) per example."""
    if len(examples) != len(completions):
        raise ValueError(f"need one completion per example, got {len(completions)} for {len(examples)}")
    for text in completions:
        if not isinstance(text, str):
            raise TypeError(f"completions must be strings, got {type(text).__name__}")


def warn_once(reward: Reward, error: str) -> None:
    if not getattr(reward, "_warned", False):
        log.warning(
            "reward %r: a scoring failed and was scored as wrong (%s); further ones are only counted",
            reward.name,
            error,
        )
        reward._warned = True


def _protected(score):
    """``score`` checked and made safe (see ``Reward``)."""

    @functools.wraps(score)
    def protected(self: Reward, examples: Sequence[Example], completions: Sequence[str], **options) -> RewardResult:
        check_batch(examples, completions)  # the caller's mistake, not the reward's: raises
        n = len(completions)
        try:
            result = score(self, examples, completions, **options)
        except (Exception, SystemExit) as err:  # sys.exit in a reward is a failed scoring, not the run's end
            warn_once(self, describe(err))
            zeros = torch.zeros(n, dtype=torch.float32)
            return RewardResult(zeros, {self.name: zeros}, n, {"error": n})
        if not isinstance(result, RewardResult):
            raise TypeError(f"reward {self.name!r}: score returned a {type(result).__name__}, not a RewardResult")
        if len(result.total) != n:
            raise ValueError(f"reward {self.name!r} returned {len(result.total)} rewards for {n} completions")
        bad = ~torch.isfinite(result.total)  # [N]
        if not bad.any():
            return result
        count = int(bad.sum())
        warn_once(self, f"{count} of {n} rewards were NaN or infinite")
        parts = {k: v.masked_fill(~torch.isfinite(v), 0.0) for k, v in result.parts.items()}
        counts = result.counts | {"error": result.counts.get("error", 0) + count}
        total, failures = result.total.masked_fill(bad, 0.0), result.failures + count
        return dataclasses.replace(result, total=total, parts=parts, failures=failures, counts=counts)

    protected.protected = True
    return protected


class SampleReward(Reward):
    """A reward scored one completion at a time by ``score_one`` -> a raw value in [0, 1].

    ``score_one`` may also return ``(value, label)``; labels are counted in ``RewardResult.counts``.
    A call that raises, returns a non-finite value or one outside [0, 1] scores 0 and is counted as a
    failure, labelled "timeout" (it timed out or raised ``TimeoutError``) or "error". With
    ``workers > 0`` calls run in a shared process pool with a ``timeout`` (seconds) per call, so a call
    that hangs is also scored 0 and counted (the reward must then be picklable); with ``workers = 0``
    they run in the caller's process and ``timeout`` is not enforced.
    The raw value r is mapped by ``scale``: "01" gives r, "pm1" gives 2r - 1 (a failure gives -1).
    """

    def __init__(self, scale: Scale = "01", name: str | None = None, workers: int = 0, timeout: float = 10.0) -> None:
        require(scale in ("01", "pm1"), f"scale must be '01' or 'pm1', got {scale!r}")
        require(workers >= 0, f"workers must be >= 0 (0 scores in this process), got {workers}")
        require(timeout > 0, f"timeout must be > 0 seconds, got {timeout}")
        self.scale = scale
        self.name = name or type(self).name
        self.workers = workers
        self.timeout = timeout

    @abstractmethod
    def score_one(self, example: Example, completion: str) -> float | tuple[float, str]:
        """Raw score in [0, 1] of one completion (optionally with a label to count)."""

    def raw_scores(self, examples: Sequence[Example], completions: Sequence[str]) -> tuple[list[float], int, dict]:
        """Unscaled values in [0, 1], the number of failures, and the label counts."""
        check_batch(examples, completions)
        calls = list(zip(examples, completions, strict=True))
        if self.workers:
            outcomes = get_pool(self.workers).run(self.score_one, calls, self.timeout)
            results = [(o.value, "") if o.ok else (None, o.error) for o in outcomes]
        else:
            results = [call_safely(self.score_one, call) for call in calls]
        values, failures, counts = [], 0, {}
        for value, error in results:
            value, label = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            if error or not _valid(value):
                failures += 1
                warn_once(self, error or f"score_one returned {value!r}, not a number in [0, 1]")
                value, label = 0.0, "timeout" if error.startswith(("timeout", "TimeoutError")) else "error"
            if label:
                counts[label] = counts.get(label, 0) + 1
            values.append(float(value))
        return values, failures, counts

    def score(
        self, examples: Sequence[Example], completions: Sequence[str], success_at: float | None = None
    ) -> RewardResult:
        """The scaled rewards; with ``success_at``, also ``success``: raw value >= ``success_at`` (a failure: False)."""
        values, failures, counts = self.raw_scores(examples, completions)
        raw = torch.tensor(values, dtype=torch.float32)  # [N]
        total = 2.0 * raw - 1.0 if self.scale == "pm1" else raw
        success = None if success_at is None else raw >= success_at - 1e-9
        return RewardResult(total, {self.name: total}, failures, counts, success)

    def grades_like(self, other: object) -> bool:
        """Does ``other`` give each completion the raw value this gives? Same class and settings, but name and scale."""

        def grading(reward: object) -> dict:
            return {k: v for k, v in vars(reward).items() if not k.startswith("_") and k not in ("name", "scale")}

        return type(other) is type(self) and grading(other) == grading(self)


def call_safely(fn, args: tuple) -> tuple[object, str]:
    try:
        return fn(*args), ""
    except (Exception, SystemExit) as err:  # sys.exit in a reward is a failed scoring, not the run's end
        return None, describe(err)


def describe(err: BaseException) -> str:
    """An exception in one phrase: ``ValueError: bad``, ``sys.exit(3)``."""
    if isinstance(err, SystemExit):
        return f"the reward called sys.exit({err.code!r})"
    return f"{type(err).__name__}: {err}"


def _valid(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and -1e-6 <= value <= 1 + 1e-6


class WeightedSum(Reward):
    """``total = sum_k weights[k] * rewards[k].total``; ``parts`` keeps every component unweighted.

    Failures and label counts are summed over the components (labels are prefixed with the
    component's name). Component names must be unique, since they key ``parts``. ``score`` with
    ``success_from`` (a component's name, a ``SampleReward``) and ``success_at`` also returns that
    component's success verdicts (``SampleReward.score``), from its one grading.
    """

    name = "weighted_sum"

    def __init__(self, rewards: list[Reward], weights: list[float] | None = None, name: str = "weighted_sum") -> None:
        require(bool(rewards), "rewards must hold at least one Reward")
        weights = [1.0] * len(rewards) if weights is None else list(weights)
        require(
            len(weights) == len(rewards),
            f"weights needs one number per reward: {len(weights)} for {len(rewards)} rewards",
        )
        names = [r.name for r in rewards]
        require(
            len(set(names)) == len(names),
            f"reward names must be unique (they key the logged parts), got {names}; set name=...",
        )
        self.rewards = list(rewards)
        self.weights = weights
        self.name = name

    def adapt_to_tokenizer(self, tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        for reward in self.rewards:
            reward.adapt_to_tokenizer(tokenizer, chat_template_kwargs)

    def score(
        self,
        examples: Sequence[Example],
        completions: Sequence[str],
        success_from: str | None = None,
        success_at: float | None = None,
    ) -> RewardResult:
        total = torch.zeros(len(completions), dtype=torch.float32)  # [N]
        parts: dict[str, Tensor] = {}
        failures, counts, success = 0, {}, None
        for reward, weight in zip(self.rewards, self.weights, strict=True):
            asked = {"success_at": success_at} if reward.name == success_from else {}
            result = reward.score(examples, completions, **asked)
            success = result.success if asked else success
            total += weight * result.total
            parts.update(result.parts)
            failures += result.failures
            counts.update({f"{reward.name}/{k}": v for k, v in result.counts.items()})
        return RewardResult(total, parts, failures, counts, success)
