"""A tool task: sums and products of numbers too long to work out in the head, with a calculator.

The prompt is one user message, ``4087*7931`` or ``4087+7931``; the answer is the exact result, ``32414000``.
The tools are plain typed functions, ``add`` and ``mul``, that a ``tasks.environment.ToolEnvironment`` runs
when the model writes ``<tool_call>{"name": "mul", "arguments": {"a": 4087, "b": 7931}}</tool_call>``; the
model reads the result in the tool's message and answers. The reward scores the episode's final assistant
message, so a model that answers at once from its head, and one that calls the tool and copies its output,
are graded alike: by exact match with the result.

``configs/tools_quickstart.yaml`` trains the tiny chat model of ``sgrpo/assets/tools_model`` on it
(docs/tasks.md, "The calculator tool task").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.base import Task
from tasks.reward import Reward
from tasks.similarity import ExactMatch

#: the operations and their symbols in prompts
SYMBOLS = {"add": "+", "mul": "*"}
#: the largest operand the tools take (larger ones are refused, so outputs stay short)
MAX_OPERAND = 10**12
MAX_LEVEL = 12

Operation = Literal["add", "mul"]


def _operand(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if abs(value) > MAX_OPERAND:
        raise ValueError(f"{name} must be at most {MAX_OPERAND:.0e} in magnitude, got {value}")
    return value


def add(a: int, b: int) -> str:
    """Add two integers: returns a + b."""
    return str(_operand("a", a) + _operand("b", b))


def mul(a: int, b: int) -> str:
    """Multiply two integers: returns a * b."""
    return str(_operand("a", a) * _operand("b", b))


#: the tools by operation
TOOLS = {"add": add, "mul": mul}


def make_example(operation: Operation, level: int, rng: random.Random) -> Example:
    """One example: two ``level``-digit operands (``level`` 1: 0-9) joined by the operation's symbol."""
    low = 0 if level == 1 else 10 ** (level - 1)
    a, b = rng.randrange(low, 10**level), rng.randrange(low, 10**level)
    answer = TOOLS[operation](a, b)
    prompt = [{"role": "user", "content": f"{a}{SYMBOLS[operation]}{b}"}]
    return Example(prompt, answer, level, {"operation": operation, "a": a, "b": b})


class CalculatorTask(Task):
    """Sums and products of two ``level``-digit numbers (``levels``: digits per operand), to be solved with the
    ``add`` and ``mul`` tools of this module (module docstring).

    Example i of a split has level ``levels[i % len(levels)]`` and operation
    ``operations[(i // len(levels)) % len(operations)]`` (balanced buckets); its operands come from a
    generator seeded by (``seed``, split), so every split is deterministic. Prompts are chat messages.

    Reward: ``ExactMatch()`` on the final assistant message by default (stripped); success is exact match
    whatever the reward.
    """

    generated = True  # Task.generated: made from num_train / num_validation / num_test

    def __init__(
        self,
        operations: list[Operation] | None = None,
        levels: list[int] | None = None,
        num_train: int = 10000,
        num_validation: int = 256,
        num_test: int = 256,
        seed: int = 0,
        reward: Reward | None = None,
        **settings,
    ) -> None:
        super().__init__(reward or ExactMatch(), **settings)
        operations = list(["add", "mul"] if operations is None else operations)
        bad = [op for op in operations if op not in SYMBOLS]
        require(bool(operations) and not bad, f"operations must be a non-empty list of {sorted(SYMBOLS)}, got "
                f"{operations}")  # fmt: skip
        levels = list([1, 2, 3] if levels is None else levels)
        ok = bool(levels) and all(isinstance(n, int) and 1 <= n <= MAX_LEVEL for n in levels)
        require(ok, f"levels must be a non-empty list of integers in [1, {MAX_LEVEL}] (digits per operand), got "
                f"{levels}")  # fmt: skip
        for key, value in (("num_train", num_train), ("num_validation", num_validation), ("num_test", num_test)):
            require(value >= 0, f"{key} must be >= 0, got {value}")
        self.operations, self.levels, self.seed = operations, levels, seed
        self.sizes = {"train": num_train, "validation": num_validation, "test": num_test}

    def load(self, split: str) -> Sequence[Example]:
        rng = random.Random(f"calculator/{self.seed}/{split}")  # str seeds are hashed with sha512: stable
        n, k = len(self.levels), len(self.operations)
        return [make_example(self.operations[(i // n) % k], self.levels[i % n], rng) for i in range(self.sizes[split])]

    def success(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer
