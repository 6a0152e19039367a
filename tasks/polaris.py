"""Polaris (``POLARIS-Project/Polaris-Dataset-53K``: problem, answer, difficulty), evaluated on AIME 2025
(``math-ai/aime25``: problem, answer, id) and MATH-500 (``HuggingFaceH4/MATH-500``: problem, solution, answer,
subject, level, unique_id): the SoftmaxGRPO paper's Qwen3 base-model runs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.base import Task, check_template, fill
from tasks.data import Schema, SplitTable, is_blank, not_blank
from tasks.mathgrade import MathVerifyReward, final_text_verifier
from tasks.paper import MATH_TEMPLATE
from tasks.reward import Reward, SampleReward

EVALUATION_SETS = {"aime25": "math-ai/aime25", "math500": "HuggingFaceH4/MATH-500"}


def answer_problem(value: object) -> str:
    """The data ``Check`` of an answer: "" for non-blank text or a finite number (AIME answers are integers; NaN, the
    float a missing value becomes, would be the gold answer "nan")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return ""
    return not_blank(value)


SCHEMA = Schema(("problem", "answer"), {"problem": not_blank, "answer": answer_problem}, "the Polaris schema")
EVALUATION_SCHEMA = Schema(
    ("problem", "answer"), {"problem": not_blank, "answer": answer_problem}, "the AIME / MATH-500 schema"
)


def _normal(text: str) -> str:
    return " ".join(str(text).split())


class Polaris(Task):
    """Polaris: user message ``template`` (the paper's ``MATH_TEMPLATE``: the problem, then "Please reason step by
    step, and put your final answer within \\\\boxed{}.") with no system message -> ``answer``.

    Train: every Polaris row whose problem (whitespace-normalised) is not an evaluation problem. Validation and
    test: the ``evaluation_sets`` (name -> hub id or local file; each source's test split, a local file's rows),
    one after the other, each its own evaluation set (``evaluation_set``: ``val/<name>/accuracy``,
    ``val/<name>/pass@k``, one table per set), each example's ``difficulty`` its row's ``level`` (MATH-500's 1-5)
    or else the set's name. Polaris' ``difficulty`` (a pass rate such as "7/8") is kept as
    ``metadata["pass_rate"]``.
    Reward (default ``final_text_verifier()``: math-verify of the final text, boxed or not) and success: as
    ``DeepMath``'s (the reward when it is a ``MathVerifyReward``, else ``verifier`` or the paper's verifier).
    """

    def __init__(
        self,
        path: str = "POLARIS-Project/Polaris-Dataset-53K",
        evaluation_sets: dict[str, str] | None = None,
        template: str = MATH_TEMPLATE,
        system_prompt: str | None = None,
        reward: Reward | None = None,
        verifier: SampleReward | None = None,
        **settings,
    ) -> None:
        super().__init__(reward or final_text_verifier(), system_prompt=system_prompt, **settings)
        check_template(template, ["question"])
        sets = dict(EVALUATION_SETS if evaluation_sets is None else evaluation_sets)
        require(bool(sets), "evaluation_sets must name at least one evaluation set (name: hub id or file)")
        self.path, self.template, self.evaluation_sets = path, template, sets
        self._table = SplitTable(path, columns=("problem", "answer", "difficulty"), schema=SCHEMA)
        self._eval_tables = {
            name: SplitTable(source, schema=EVALUATION_SCHEMA, field=f"evaluation_sets.{name}")
            for name, source in sets.items()
        }
        is_math_verify = isinstance(self.reward, MathVerifyReward)
        self.success_grader = verifier or (self.reward if is_math_verify else final_text_verifier(name="success"))

    def load(self, split: str) -> Sequence[Example]:
        evaluation = [self._example(row, name) for name in self._eval_tables for row in self._eval_rows(name)]
        if split != "train":
            return evaluation
        held_out = {_normal(e.metadata["question"]) for e in evaluation}
        rows = [row for row in self._table.rows("train") if _normal(row["problem"]) not in held_out]
        return [self._example(row, None) for row in rows]

    def evaluation_set(self, example: Example) -> str:
        return example.metadata.get("evaluation_set", "")

    def _eval_rows(self, name: str) -> list[Mapping]:
        table = self._eval_tables[name]
        return table.rows("test" if "test" in table.splits() else "train")

    def _example(self, row: Mapping, evaluation_set: str | None) -> Example:
        question = str(row["problem"]).strip()
        metadata = {"question": question, "source": evaluation_set or self.path}
        difficulty = None
        if evaluation_set is None and not is_blank(row.get("difficulty")):
            metadata["pass_rate"] = str(row["difficulty"])
        elif evaluation_set is not None:
            metadata["evaluation_set"] = evaluation_set
            difficulty = evaluation_set if is_blank(row.get("level")) else row["level"]
        answer = row["answer"]
        answer = str(int(answer) if isinstance(answer, float) and answer.is_integer() else answer).strip()
        prompt = [{"role": "user", "content": fill(self.template, question=question)}]
        return Example(prompt, answer, difficulty, metadata)
