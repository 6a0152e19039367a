"""Synthetic verifiable tasks for CPU runs of a tiny char-level model."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.base import Task
from tasks.reward import Reward
from tasks.similarity import ExactMatch

#: every character a synthetic prompt or answer uses
VOCABULARY = "0123456789+=:s"
DEFAULT_LEVELS = {"sort": [3, 5, 7], "add": [1, 2, 3], "dsum": [1, 2, 3, 4, 6]}
MAX_LEVEL = 20

Kind = Literal["sort", "add", "dsum"]


def make_example(kind: Kind, level: int, rng: random.Random) -> Example:
    """One raw-text example of ``kind`` at difficulty ``level``.

    sort: ``s:3142=`` -> ``1234`` (n = level digits, repeats allowed);
    add: ``408+793=`` -> ``1021`` (two level-digit numbers, sum written least significant digit first);
    dsum: ``9274=`` -> ``2`` (sum of level digits, mod 10).
    """
    if kind == "add":
        low = 0 if level == 1 else 10 ** (level - 1)
        a, b = rng.randrange(low, 10**level), rng.randrange(low, 10**level)
        return Example(f"{a}+{b}=", str(a + b)[::-1], level, {"task": kind, "answer_plain": str(a + b)})
    digits = [rng.randrange(10) for _ in range(level)]
    text = "".join(map(str, digits))
    if kind == "sort":
        return Example(f"s:{text}=", "".join(map(str, sorted(digits))), level, {"task": kind})
    return Example(f"{text}=", str(sum(digits) % 10), level, {"task": kind})


class SyntheticTask(Task):
    """Generated digit tasks (``sort``, ``add``, ``dsum``) with levels mixed in every split.

    Example i of a split has level ``levels[i % len(levels)]`` (balanced buckets) and its digits drawn
    from a generator seeded by (``seed``, split), so every split is deterministic. Splits are drawn
    independently: for small levels (10 ``dsum`` prompts of one digit) evaluation prompts repeat
    training ones. Prompts are raw strings over ``VOCABULARY``; answers are compared after ``strip()``.

    Reward: ``ExactMatch()`` (binary) by default, or e.g. ``EditSimilarity()`` for the continuous
    path (normalised Levenshtein similarity). Success is exact match, whatever the reward.
    """

    generated = True  # Task.generated: made from num_train / num_validation / num_test

    def __init__(
        self,
        kind: Kind = "sort",
        levels: list[int] | None = None,
        num_train: int = 10000,
        num_validation: int = 256,
        num_test: int = 256,
        seed: int = 0,
        reward: Reward | None = None,
        **settings,
    ) -> None:
        super().__init__(reward or ExactMatch(), **settings)
        require(kind in DEFAULT_LEVELS, f"kind must be one of {sorted(DEFAULT_LEVELS)}, got {kind!r}")
        levels = list(DEFAULT_LEVELS[kind] if levels is None else levels)
        ok = bool(levels) and all(1 <= n <= MAX_LEVEL for n in levels)
        require(ok, f"levels must be a non-empty list of integers in [1, {MAX_LEVEL}], got {levels}")
        for key, value in (("num_train", num_train), ("num_validation", num_validation), ("num_test", num_test)):
            require(value >= 0, f"{key} must be >= 0, got {value}")
        self.kind, self.levels, self.seed = kind, levels, seed
        self.sizes = {"train": num_train, "validation": num_validation, "test": num_test}

    def load(self, split: str) -> Sequence[Example]:
        rng = random.Random(f"{self.seed}/{split}")  # str seeds are hashed with sha512: stable across runs
        return [make_example(self.kind, self.levels[i % len(self.levels)], rng) for i in range(self.sizes[split])]

    def success(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer
