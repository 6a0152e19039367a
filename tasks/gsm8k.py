"""GSM8K (``openai/gsm8k``, config ``main``: question, answer): grade-school word problems."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sgrpo.types import Example
from tasks.base import Task, check_template, fill
from tasks.data import Schema, SplitTable, is_blank, not_blank
from tasks.holdout import check_size
from tasks.mathgrade import NumericMatch
from tasks.paper import MATH_TEMPLATE as TEMPLATE
from tasks.reward import Reward, SampleReward


def gold_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, commas removed: ``"... #### 1,710"`` -> ``"1710"``."""
    if "####" not in solution:
        raise ValueError(f"a GSM8K answer must end with '#### <number>', got {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def solution_problem(value: object) -> str:
    """The data ``Check`` of the answer column: "" for a solution ending in ``#### <number>``."""
    if is_blank(value):
        return f"is empty ({value!r})"
    if "####" not in str(value):
        return "has no final '#### <number>' line"
    gold = gold_answer(str(value))
    try:
        float(gold)
    except ValueError:
        return f"has no number after '####' ({gold!r})"
    return ""


SCHEMA = Schema(("question", "answer"), {"question": not_blank, "answer": solution_problem}, "the GSM8K schema")


class GSM8K(Task):
    """GSM8K: chat prompt (the question + ``TEMPLATE``'s instruction) -> the number after ``####``.

    The hub set has train (7,473) and test (1,319) splits; ``validation_size`` rows (a count or a
    fraction) are held out of train with ``seed``, and ``test_size`` likewise when the source has no
    test split (a single local file is a train split). Reward (default ``NumericMatch()``): the last
    number of the last ``\\boxed{}`` (else of the text) equals the gold number; swap in
    ``MathVerifyReward(require_box=False)`` for sympy equivalence. Success: ``verifier`` (default
    ``NumericMatch``); one grading gives both when the reward grades as it does. ``validate_on_test`` validates
    on the source's test split (the SoftmaxGRPO paper's protocol: the official train / test splits) instead of
    rows held out of train. ``Example.difficulty`` is the number of reasoning steps (lines before ``####``) of
    the solution; ``metadata["solution"]`` is the full solution, the reference of a similarity reward
    (``WordSimilarity(reference="solution")``).
    """

    def __init__(
        self,
        path: str = "openai/gsm8k",
        config: str | None = "main",
        template: str = TEMPLATE,
        system_prompt: str | None = None,
        validation_size: int | float = 0.05,
        test_size: int | float = 0,
        seed: int = 0,
        reward: Reward | None = None,
        verifier: SampleReward | None = None,
        validate_on_test: bool = False,
        **settings,
    ) -> None:
        super().__init__(reward or NumericMatch(), system_prompt=system_prompt, **settings)
        check_template(template, ["question"])
        check_size(validation_size, "validation_size")
        check_size(test_size, "test_size")
        self.path, self.template, self.seed, self.validate_on_test = path, template, seed, validate_on_test
        sizes = {"validation": 0 if validate_on_test else validation_size, "test": test_size}
        self._table = SplitTable(path, config, ("question", "answer"), SCHEMA, sizes, seed)
        # the default reward's check: graded once with it (Task.score)
        self.success_grader = verifier or NumericMatch(name="success")

    def load(self, split: str) -> Sequence[Example]:
        split = "test" if split == "validation" and self.validate_on_test else split
        return [self._example(row) for row in self._table.rows(split)]

    def _example(self, row: Mapping) -> Example:
        solution = str(row["answer"])
        steps = sum(1 for line in solution.split("####")[0].splitlines() if line.strip())
        messages = [{"role": "user", "content": fill(self.template, question=str(row["question"]).strip())}]
        return Example(messages, gold_answer(solution), steps, {"solution": solution})  # system prompt: Task.examples
