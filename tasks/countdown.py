"""Countdown (``Jiayi-Pan/Countdown-Tasks-3to4``: target, nums): reach the target with each number once.

``CountdownGold`` is its text-similarity variant, the SoftmaxGRPO paper's countdown_sim: the same prompts,
rewarded by similarity to a solution written by Qwen2.5-7B-Instruct and verified
(``HuggingFaceTB/Countdown-Task-GOLD``, config ``verified_Qwen2.5-7B-Instruct``); success stays the verifier.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

from sgrpo.types import Example
from tasks.arithmetic import CountdownReward
from tasks.base import Task, check_template, fill
from tasks.data import Schema, SplitTable, is_blank
from tasks.deepmath import prompt_problem
from tasks.holdout import check_holdout, check_size, paper_carver, prompt_uid
from tasks.paper import COUNTDOWN_TEMPLATE, SYSTEM_PROMPT
from tasks.reward import Reward, SampleReward
from tasks.similarity import WordSimilarity

_NUMBERS = re.compile(r"numbers\s*\[([\d,\s]+)\]")
_TARGET = re.compile(r"equals\s*(\d+)")


def integer_problem(value: object) -> str:
    """The data ``Check`` of ``target``: "" for an integer (a whole float such as 24.0 too; not NaN or infinity, the
    float a missing value becomes)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        return f"is not an integer ({value!r})"
    return ""


def numbers_problem(value: object) -> str:
    """The data ``Check`` of ``nums``: "" for a non-empty list of integers."""
    if not isinstance(value, (list, tuple)) or not value:
        return f"is not a non-empty list of integers ({str(value)[:80]!r})"
    bad = next((v for v in value if integer_problem(v)), None)
    return f"holds {bad!r}, not an integer" if bad is not None else ""


def optional(check):
    """``check``, passing a blank value (a column some rows or sources lack)."""
    return lambda value: "" if is_blank(value) else check(value)


SCHEMA = Schema(
    ("target", "nums"), {"target": integer_problem, "nums": numbers_problem}, "the Countdown schema (target, nums)"
)
GOLD_SCHEMA = Schema(
    ("messages",),
    {"messages": prompt_problem, "target": optional(integer_problem), "nums": optional(numbers_problem)},
    "the Countdown-GOLD schema (messages: user then assistant; target and nums read from the user message when "
    "the rows lack them)",
)


class Countdown(Task):
    """Countdown: ``template`` (the paper's, ``COUNTDOWN_TEMPLATE``) with {nums} and {target}, after the paper's
    ``system_prompt``; ``Example.answer`` is the target, ``metadata["nums"]`` the numbers, ``difficulty`` their
    count (3 or 4).

    The hub set has a train split only (about 490K rows): validation and test are held out by
    ``tasks.holdout.hash_holdout`` (distinct prompts ranked by a hash of ``seed`` and the prompt, at most 10 %;
    ``validation_size`` 1,000 and seed 42 by default); ``holdout="paper"`` holds out the authors' prompts instead
    (``tasks.holdout.paper_holdout`` over the ids of the system and user messages; the paper's 500, seed 42).
    Reward (default ``CountdownReward()``) and success: the paper's verifier (``tasks.arithmetic.grade_countdown``);
    ``verifier`` replaces the success test. Rows are checked at load: ``target`` an integer, ``nums`` a non-empty
    list of integers.
    """

    schema = SCHEMA

    def __init__(
        self,
        path: str = "Jiayi-Pan/Countdown-Tasks-3to4",
        config: str | None = None,
        template: str = COUNTDOWN_TEMPLATE,
        system_prompt: str | None = SYSTEM_PROMPT,
        validation_size: int | float = 1000,
        test_size: int | float = 0,
        seed: int = 42,
        reward: Reward | None = None,
        verifier: SampleReward | None = None,
        holdout: Literal["hash", "paper"] = "hash",
        **settings,
    ) -> None:
        super().__init__(reward or CountdownReward(), system_prompt=system_prompt, **settings)
        check_template(template, ["nums", "target"])
        check_size(validation_size, "validation_size")
        check_size(test_size, "test_size")
        check_holdout(holdout, validation_size, test_size)
        self.path, self.config, self.template, self.seed, self.holdout = path, config, template, seed, holdout
        sizes = {"validation": validation_size, "test": test_size}
        carve = paper_carver(lambda row: prompt_uid(self.system_prompt, self._key(row))) if holdout == "paper" else None
        self._table = SplitTable(path, config, None, self.schema, sizes, seed, group=self._key, carve=carve)
        default = self.reward if isinstance(self.reward, CountdownReward) else CountdownReward(name="success")
        self.success_grader = verifier or default

    def problem(self, row: Mapping) -> tuple[list[int], int]:
        """The numbers and the target of a row."""
        return [int(n) for n in row["nums"]], int(row["target"])

    def _key(self, row: Mapping) -> str:
        nums, target = self.problem(row)
        return fill(self.template, nums=nums, target=target)

    def load(self, split: str) -> Sequence[Example]:
        return [self._example(row) for row in self._table.rows(split)]

    def _example(self, row: Mapping) -> Example:
        nums, target = self.problem(row)
        messages = [{"role": "user", "content": fill(self.template, nums=nums, target=target)}]
        return Example(messages, str(target), len(nums), {"nums": nums, **self.extra(row)})

    def extra(self, row: Mapping) -> dict:
        """More metadata of a row (``CountdownGold``: the reference)."""
        return {}


class CountdownGold(Countdown):
    """countdown_sim: Countdown's prompts (built from each row's numbers and target, as ``Countdown`` builds them),
    rewarded by ``WordSimilarity`` against the row's last assistant message (``metadata["reference"]``).

    Reads ``HuggingFaceTB/Countdown-Task-GOLD`` (config ``verified_Qwen2.5-7B-Instruct``) or local files in its
    schema: ``messages`` (``{role, content}`` dicts: the user's problem, the assistant's verified solution);
    ``target`` and ``nums`` columns when the rows have them, else read from the user message ("Using the numbers
    [..], create an equation that equals T"). Success: the Countdown verifier on those numbers and target.
    """

    schema = GOLD_SCHEMA

    def __init__(
        self,
        path: str = "HuggingFaceTB/Countdown-Task-GOLD",
        config: str | None = "verified_Qwen2.5-7B-Instruct",
        reward: Reward | None = None,
        **settings,
    ) -> None:
        super().__init__(path=path, config=config, reward=reward or WordSimilarity(), **settings)

    def problem(self, row: Mapping) -> tuple[list[int], int]:
        if not is_blank(row.get("nums")) and not is_blank(row.get("target")):
            return super().problem(row)
        users = [m["content"] for m in row["messages"] if m.get("role") == "user"]
        numbers, target = _NUMBERS.search(users[-1]), _TARGET.search(users[-1])
        if numbers is None or target is None:
            raise ValueError(f"a Countdown-GOLD row has no target and nums columns, and its user message names no "
                             f"'numbers [..]' and 'equals T': {users[-1][:120]!r}")  # fmt: skip
        return [int(n) for n in numbers.group(1).replace(",", " ").split()], int(target.group(1))

    def extra(self, row: Mapping) -> dict:
        answers = [m["content"] for m in row["messages"] if m.get("role") == "assistant"]
        if not answers or not str(answers[-1]).strip():
            raise ValueError(f"a Countdown-GOLD row has no assistant message to use as reference: {row['messages']!r}")
        return {"reference": str(answers[-1])}
