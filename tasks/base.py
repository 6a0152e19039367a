"""The task interface: datasets of ``Example`` s, a reward, and a success test.

A ``Task`` holds its reward (``tasks.reward``: every ``Reward`` is protected, a failed scoring scores 0
and is counted) and a separate ``success`` test, so accuracy means the same whatever reward shaping a run
uses; ``Task.score`` gives both, from one grading when the reward grades as the test does. The reward
interface is re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sgrpo.lazy import Mapped, is_lazy
from sgrpo.types import Example
from tasks.reward import (  # noqa: F401 (the reward interface stays importable from tasks.base)
    Reward,
    RewardResult,
    SampleReward,
    Scale,
    WeightedSum,
    call_safely,
    check_batch,
    require,
    settings_repr,
)

log = logging.getLogger(__name__)
SPLITS = ("train", "validation", "test")


class Task(ABC):
    """A dataset of ``Example`` s per split (train / validation / test), a reward, and a success test.

    Subclasses implement ``load(split)`` (called once per split, then cached) and either ``success`` or,
    when success is a grader's raw value reaching a threshold, ``success_grader`` and ``success_threshold``
    (then ``success``, ``successes`` and a single grading in ``score`` come with them).
    ``max_train_examples`` / ``max_eval_examples`` keep the first examples of the train split /
    of the validation and test splits. ``system_prompt`` opens every chat prompt as a system message
    (a task whose prompts are raw text refuses it), and ``chat_template_kwargs`` go with every chat prompt
    to the tokenizer's chat template (``{"enable_thinking": false}`` for Qwen3), for sampling, for the
    prompt-length guard and for the reward's reading of the template (``adapt_to_tokenizer``).
    These are the settings every task has: a subclass takes its own arguments and passes the rest on as
    ``**settings`` (configs and ``--help`` see them all).
    """

    success_grader: SampleReward | None = None  # whose raw value decides success, if the task has one
    success_threshold: float = 1.0  # ... by reaching this value
    #: the examples are made in memory from the settings (no file, no hub; ``num_<split>`` of them): cheap enough
    #: for the preflight to read each split the command needs before any model loads
    generated: bool = False

    def __init__(
        self,
        reward: Reward,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(reward, Reward):
            raise TypeError(f"reward must be a Reward, got {type(reward).__name__}")
        for key, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
            require(value is None or value >= 1, f"{key} must be >= 1 or None (no limit), got {value}")
        self.reward = reward
        self.max_train_examples = max_train_examples
        self.max_eval_examples = max_eval_examples
        self.system_prompt, self.chat_template_kwargs = system_prompt, dict(chat_template_kwargs or {})
        self._cache: dict[str, Sequence[Example]] = {}

    def examples(self, split: str) -> Sequence[Example]:
        """The examples of ``split``, one of "train", "validation", "test"."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if split not in self._cache:
            limit = self.max_train_examples if split == "train" else self.max_eval_examples
            loaded = self.load(split)
            if is_lazy(loaded):  # a memory-mapped source (tasks.lazy_table): examples built when read
                settings = functools.partial(chat_settings, type(self).__name__, self.system_prompt,
                                             self.chat_template_kwargs)  # fmt: skip
                self._cache[split] = Mapped(loaded if limit is None else loaded[:limit], settings)
            else:
                self._cache[split] = [self._chat_settings(ex) for ex in list(loaded)[:limit]]
        return self._cache[split]

    def _chat_settings(self, example: Example) -> Example:
        """``example`` with the system prompt before its messages and the chat-template kwargs (its own win)."""
        return chat_settings(type(self).__name__, self.system_prompt, self.chat_template_kwargs, example)

    def adapt_to_tokenizer(self, tokenizer) -> None:
        """Called by the policy with the tokenizer it samples with, before any grading: adapts the graders to
        its chat template as the task renders it (``chat_template_kwargs``)."""
        self.reward.adapt_to_tokenizer(tokenizer, self.chat_template_kwargs)
        if self.success_grader is not None and self.success_grader is not self.reward:
            self.success_grader.adapt_to_tokenizer(tokenizer, self.chat_template_kwargs)

    def evaluation_set(self, example: Example) -> str:
        """The evaluation set of a validation or test ``example``: a name without '/', each set logged and tabled
        on its own (``val/<name>/accuracy``, ``val/<name>/pass@k``, ...), or "" (the default) for a split of one
        set, logged as ``val/accuracy``, ``val/pass@k``, ..."""
        return ""

    @abstractmethod
    def load(self, split: str) -> Sequence[Example]:
        """All examples of ``split`` (a valid split name)."""

    def success(self, example: Example, completion: str) -> bool:
        """Is ``completion`` a correct answer to ``example``? Independent of the reward's shaping.

        By default: the ``success_grader``'s raw value reaches ``success_threshold``.
        """
        if self.success_grader is None:
            raise NotImplementedError(f"{type(self).__name__} must implement success() or set success_grader")
        return bool(self.successes([example], [completion])[0])

    def successes(self, examples: Sequence[Example], completions: Sequence[str]) -> Tensor:
        """``[N]`` bool: ``success`` of each pair; a test that raises, or a failed grading, counts as not successful."""
        check_batch(examples, completions)
        if self.success_grader is not None:
            result = self.success_grader.score(examples, completions, success_at=self.success_threshold)
            failed = len(completions) if result.success is None else result.failures
            self._note_success_failures(failed, len(completions), ", ".join(f"{k} {v}" for k, v in result.counts.items()
                                                                           if k in ("error", "timeout")))  # fmt: skip
            return torch.zeros(len(completions), dtype=torch.bool) if result.success is None else result.success
        calls = [call_safely(self.success, c) for c in zip(examples, completions, strict=True)]
        errors = [error for _, error in calls if error]
        self._note_success_failures(len(errors), len(calls), f"first: {errors[0]}" if errors else "")
        return torch.tensor([bool(value) for value, _ in calls], dtype=torch.bool)

    def _note_success_failures(self, failed: int, total: int, detail: str) -> None:
        """Warn where a success test raised or timed out (those completions count as not successful, and every
        success rate, pass@k and difficulty bucket reads them so): at the first failure, then at each tenfold."""
        if not failed:
            return
        before = self.__dict__.get("_success_failures", 0)
        after = self.__dict__["_success_failures"] = before + failed
        if before == 0 or len(str(after)) > len(str(before)):
            log.warning("%s: the success test failed on %d of %d completions (%s); %d so far, each counted as not "
                        "successful", type(self).__name__, failed, total, detail or "no detail", after)  # fmt: skip

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> RewardResult:
        """The reward's result for each completion, with ``success`` filled in by the task's success test.

        Graded once when the reward, or one part of a ``WeightedSum`` reward, grades as ``success_grader`` does
        (``SampleReward.grades_like``: the same class and settings, up to name and scale, as DeepMath's, GSM8K's
        and MeetingBank's defaults): its raw values give both. Otherwise, or when that scoring failed as a
        whole, ``successes`` runs apart.
        """
        reward, at = self.reward, self.success_threshold
        parts = reward.rewards if isinstance(reward, WeightedSum) else [reward]
        alike = [r for r in parts if self._grades_for_success(r)]
        if alike and alike[0] is reward:
            result = reward.score(examples, completions, success_at=at)
        elif alike and isinstance(reward, WeightedSum):
            result = reward.score(examples, completions, success_from=alike[0].name, success_at=at)
        else:
            result = reward.score(examples, completions)
        if result.success is None or not alike:
            return dataclasses.replace(result, success=self.successes(examples, completions))
        prefix = "" if alike[0] is reward else f"{alike[0].name}/"  # a WeightedSum labels its parts' counts
        labels = (f"{prefix}error", f"{prefix}timeout")
        failed = {k.removeprefix(prefix): v for k, v in result.counts.items() if k in labels}
        detail = ", ".join(f"{k} {v}" for k, v in failed.items())
        self._note_success_failures(sum(failed.values()), len(completions), detail)
        return result

    def _grades_for_success(self, reward: Reward) -> bool:
        grader = self.success_grader
        return grader is not None and isinstance(reward, SampleReward) and reward.grades_like(grader)

    def __repr__(self) -> str:
        return settings_repr(self)


def chat_settings(task: str, system_prompt: str | None, kwargs: dict[str, Any], example: Example) -> Example:
    """``example`` with ``system_prompt`` before its messages and the chat-template ``kwargs`` (its own win);
    ``task`` (its class name) names the task in the error for a raw-text prompt."""
    prompt = example.prompt
    if system_prompt:
        require(not isinstance(prompt, str), f"system_prompt needs chat prompts; {task} gave raw "
                f"text ({prompt[:40]!r}): set chat: true, or system_prompt: null")  # fmt: skip
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    if prompt is example.prompt and not kwargs:
        return example
    return dataclasses.replace(example, prompt=prompt, chat_template_kwargs={**kwargs, **example.chat_template_kwargs})


def fill(template: str, **fields: object) -> str:
    """Replace each ``{name}`` in ``template`` by ``fields[name]`` (other braces, as in LaTeX, stay)."""
    for key, value in fields.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def check_template(template: str, required: Sequence[str], field: str = "template") -> None:
    """Raise unless ``template`` holds every ``{name}`` placeholder of ``required``."""
    missing = [name for name in required if "{" + name + "}" not in template]
    require(not missing, f"{field} must contain the placeholder(s) {', '.join('{' + m + '}' for m in missing)}")
