"""Reward functions as plain callables, as TRL's GRPOTrainer takes them: ``f(prompts, completions, **columns)``.

A config names the function by import path (``function: mymodule.my_reward``); several go in a
``WeightedSum`` with weights, each logged under its own name (``train/reward/<name>``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.pool import get_pool, require_picklable
from tasks.reward import Reward, RewardResult, warn_once

#: keyword arguments a reward function gets besides the example's metadata columns
RESERVED = ("prompts", "completions", "answer", "difficulty")


class FunctionReward(Reward):
    """A plain function as a reward: ``function(prompts=..., completions=..., **columns)`` -> one float per
    completion, or None where it does not apply (scored 0, counted as "none", not a failure).

    The function is called with keywords, as TRL calls it: ``prompts`` (each completion's prompt: text, or
    chat messages with the task's system prompt), ``completions`` and the example's columns as lists of one
    value per completion: ``answer``, ``difficulty`` and each ``metadata`` key (None where an example lacks
    it). It takes what it needs and ``**kwargs`` for the rest. ``completion_format`` "auto" passes a
    completion as TRL does: ``[{"role": "assistant", "content": text}]`` after a chat prompt, the text after
    a raw-text one; "text" always passes the text, "messages" always the message list.

    Protected like every reward: a call that raises, or returns a number of values other than one per
    completion, scores 0 for the whole batch and counts each completion as a failure; a value that is not a
    finite number scores 0 and is counted. ``workers=0`` (the default, as TRL) calls the function in this
    process without a time limit; ``workers >= 1`` calls it in a worker process with ``timeout`` seconds
    for the batch, so a call that hangs also scores 0 and is counted (the function must then be importable
    by name, and should not use CUDA). ``name`` (default: the function's ``__name__``) keys its part.
    """

    name = "function"

    def __init__(
        self,
        function: Callable[..., Sequence[float | None]],
        name: str | None = None,
        completion_format: Literal["auto", "text", "messages"] = "auto",
        workers: int = 0,
        timeout: float = 60.0,
    ) -> None:
        require(callable(function), f"function must be callable, got {type(function).__name__}")
        require(completion_format in ("auto", "text", "messages"), "completion_format must be auto, text or messages")
        require(workers >= 0, f"workers must be >= 0 (0 calls it in this process), got {workers}")
        require(timeout > 0, f"timeout must be > 0 seconds, got {timeout}")
        if workers:
            require_picklable(function, "function", "set workers: 0")
        self.function = function
        self.name = name or getattr(function, "__name__", type(function).__name__)
        self.completion_format, self.workers, self.timeout = completion_format, workers, timeout

    def arguments(self, examples: Sequence[Example], completions: Sequence[str]) -> dict[str, Any]:
        """The keyword arguments of one call: prompts, completions and the examples' columns, as lists."""
        keys = dict.fromkeys(key for ex in examples for key in ex.metadata if key not in RESERVED)
        columns = {key: [ex.metadata.get(key) for ex in examples] for key in keys}
        return {
            "prompts": [ex.prompt for ex in examples],
            "completions": [self._completion(ex, text) for ex, text in zip(examples, completions, strict=True)],
            "answer": [ex.answer for ex in examples],
            "difficulty": [ex.difficulty for ex in examples],
            **columns,
        }

    def _completion(self, example: Example, text: str) -> str | list[dict[str, str]]:
        chat = self.completion_format == "messages" or (
            self.completion_format == "auto" and not isinstance(example.prompt, str)
        )
        return [{"role": "assistant", "content": text}] if chat else text

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> RewardResult:
        n, kwargs = len(completions), self.arguments(examples, completions)
        if not self.workers:
            return self.result(_call(self.function, kwargs), n)
        outcome = get_pool(self.workers).run(_call, [(self.function, kwargs)], self.timeout)[0]
        if outcome.ok:
            return self.result(outcome.value, n)
        warn_once(self, outcome.error)
        zeros = torch.zeros(n, dtype=torch.float32)
        return RewardResult(zeros, {self.name: zeros}, n, {_label(outcome.error): n})

    def result(self, values: list, n: int) -> RewardResult:
        """The result of the function's ``values`` for ``n`` completions (raises if there are not ``n``)."""
        require(len(values) == n, f"{self.name} returned {len(values)} values for {n} completions")
        total, counts = [], {}
        for value in values:
            number = value is not None and not isinstance(value, (str, bytes)) and hasattr(value, "__float__")
            label = "none" if value is None else None if number else "error"
            total.append(float(value) if number else 0.0)
            if label:
                counts[label] = counts.get(label, 0) + 1
        if counts.get("error"):
            warn_once(self, f"{counts['error']} of {n} values were not numbers")
        total = torch.tensor(total, dtype=torch.float32)  # [N]; NaN and infinity: scored 0 and counted by score
        return RewardResult(total, {self.name: total}, counts.get("error", 0), counts)


def _label(error: str) -> str:
    return "timeout" if error.startswith(("timeout", "TimeoutError")) else "error"


def _call(function: Callable, kwargs: dict[str, Any]) -> list:
    return list(function(**kwargs))  # a list: a generator neither has a length nor leaves a worker process
