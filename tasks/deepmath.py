"""DeepMath-103K (arXiv 2504.11456): hard math problems with verifiable final answers."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Literal

from sgrpo.checks import require
from sgrpo.lazy import Mapped, is_lazy, take
from sgrpo.types import Example
from tasks.base import Task, check_template, fill
from tasks.data import Schema, SplitTable, is_blank, not_blank, number_or_blank
from tasks.holdout import check_holdout, check_size, paper_carver, prompt_uid
from tasks.lazy_table import LazySplitTable
from tasks.reward import Reward, SampleReward
from tasks.similarity import final_text

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
_COLUMNS = ("question", "final_answer", "difficulty", "topic", "prompt", "solution")
SOLUTIONS = ("r1_solution_1", "r1_solution_2", "r1_solution_3")


def prompt_problem(value: object) -> str:
    """The data ``Check`` of a trl-lib ``prompt``: "" if it holds a user message with content."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
        return f"is not a list of {{role, content}} messages ({str(value)[:80]!r})"
    if not any(m.get("role") == "user" and str(m.get("content") or "").strip() for m in value):
        return "holds no user message with content"
    return ""


#: the two accepted row layouts: zwhe99/DeepMath-103K's, and trl-lib/DeepMath-103K's
SCHEMAS = (
    Schema(
        ("question", "final_answer"),
        {"question": not_blank, "final_answer": not_blank, "difficulty": number_or_blank},
        "the DeepMath schema",
    ),
    Schema(("prompt", "solution"), {"prompt": prompt_problem, "solution": not_blank}, "the trl-lib schema"),
)


class DeepMath(Task):
    """DeepMath: chat prompt (system ``system_prompt``, default ``SYSTEM_PROMPT``, + the question) -> ``final_answer``.

    Reads ``zwhe99/DeepMath-103K`` (hub id) or local files in its schema (``question, final_answer,
    difficulty, topic``), or in the ``trl-lib/DeepMath-103K`` schema (``prompt`` = list of
    ``{content, role}``, ``solution``; the last user message is the question, there is no difficulty).
    The hub set has only a train split: ``validation_size`` / ``test_size`` rows (a count or a
    fraction) are held out of it with ``seed``. ``test_path`` instead reads the test split from another
    source (e.g. ``trl-lib/DeepMath-103K``, whose test rows are also in zwhe99's train): its questions
    are removed from train and validation, and its rows get their difficulty from ``path`` by question.
    Rows are checked at load (``SCHEMAS``): a file row without a question or answer, or with a blank one,
    raises ``ValueError`` naming the file, the row and the column.

    Reward (default ``MathVerifyReward()``): 1 if math-verify finds the answer after ``</think>`` equal to
    ``final_answer``, else 0. Success is that same check on the {0, 1} scale, whatever reward is configured:
    with the reward's settings when it is a ``MathVerifyReward`` (then one grading gives reward and success,
    ``Task.score``), else with the defaults.
    ``Example.difficulty`` is the AoPS-scale rating (3 to 9.5). ``verifier`` replaces the success test
    (default: as above). ``template`` makes the user message from ``{question}``. ``holdout="hash"`` holds
    validation and test out by ``tasks.holdout.hash_holdout`` (distinct questions ranked by a hash of seed and
    question, at most 10 % of them; the SoftmaxGRPO paper's 1,000 with seed 42) instead of random rows.
    ``reference_solutions`` reads ``r1_solution_1..3`` and gives each example ``metadata["reference"]``: the
    shortest ``final_text`` of the three (in characters; the first on a tie), the reference of a similarity
    reward (``WordSimilarity``), from ``test_path``'s rows too (one without those columns, as trl-lib's, gives
    none, with a warning: the reward then reads the answer). The grading options, set on the reward:

    - ``require_think`` (default None: from the chat template): with a thinking model whose template opens
      ``<think>`` in the prompt (DeepSeek-R1-Distill), a completion without ``</think>`` was cut off
      mid-thought and scores 0, whatever its draft boxed. The policy calls ``adapt_to_tokenizer`` with its
      tokenizer to decide; set True or False to override.
    - ``require_box`` (default True): the answer is the last ``\\boxed{}`` after ``</think>``. False also
      grades an unboxed answer there ("Hence the answer is 4.", as DeepMath's authors do). The box stays
      the default: the prompt asks for it, and free text is read by its last number, which is often not the
      answer ("3 steps, so 2 moves" is graded as 2).
    - ``scale`` (default "01"): "pm1" gives the authors' +1/-1.

    Always on: a gold listing several parts (``2, 3``) is graded against all the boxes after ``</think>``
    together; e-notation (``1.2e5``), ``d.dd\\times10^{n}`` and ``\\mathbb Z`` spellings are read as meant;
    a gold printed as a rounded decimal (``0.866``, 3 or more significant digits) accepts an answer within
    half a unit of its last digit (``\\frac{\\sqrt{3}}{2}``), never looser (not 0.87). Other golds get no
    tolerance beyond math-verify's own (decimals equal to 6 places): 400 or 0.04 for 4, 0.3333 for 1/3,
    ``2^{2022}`` for ``2^{2023}``, ``(-\\infty, 2)`` for ``(-\\infty, 2]`` all score 0.
    """

    def __init__(
        self,
        path: str = "zwhe99/DeepMath-103K",
        validation_size: int | float = 0.01,
        test_size: int | float = 0,
        test_path: str | None = None,
        seed: int = 0,
        system_prompt: str | None = SYSTEM_PROMPT,
        reward: Reward | None = None,
        verifier: SampleReward | None = None,
        template: str = "{question}",
        holdout: Literal["random", "hash", "paper"] = "random",
        reference_solutions: bool = False,
        **settings,
    ) -> None:
        from tasks.mathgrade import MathVerifyReward  # imported here: Countdown reads prompt_problem without sympy

        super().__init__(reward or MathVerifyReward(), system_prompt=system_prompt, **settings)
        check_template(template, ["question"])
        require(holdout in ("random", "hash", "paper"), f"holdout must be 'random', 'hash' or 'paper', got {holdout!r}")
        if holdout != "random":
            check_holdout(holdout, validation_size, test_size)
        check_size(validation_size, "validation_size")
        check_size(test_size, "test_size")
        require(
            test_path is None or not test_size, f"set either test_path or test_size, not both (test_size={test_size!r})"
        )
        self.path, self.test_path, self.seed, self.template = path, test_path, seed, template
        self.holdout, self.reference_solutions = holdout, reference_solutions
        sizes = {"validation": validation_size, "test": test_size}
        columns = _COLUMNS + SOLUTIONS if reference_solutions else _COLUMNS
        group = _row_question if holdout == "hash" else None
        carve = paper_carver(self._uid) if holdout == "paper" else None
        self._table = LazySplitTable(
            path, columns=columns, schema=SCHEMAS, sizes=sizes, seed=seed, group=group, carve=carve
        )
        self._test_table = (
            None if test_path is None else SplitTable(test_path, columns=columns, schema=SCHEMAS, field="test_path")
        )
        # success is math-verify's verdict: the reward's own when it is one (its raw value, whatever its scale)
        is_math_verify = isinstance(self.reward, MathVerifyReward)
        self.success_grader = verifier or (self.reward if is_math_verify else MathVerifyReward(name="success"))

    def load(self, split: str) -> Sequence[Example]:
        if self._test_table is None:
            return self._examples(self._table, split)
        test_split = "test" if "test" in self._test_table.splits() else "train"
        test = self._examples(self._test_table, test_split, self._test_references(test_split))
        if split == "test":
            known = {}  # one pass over the rows, each dropped once read (a list held every row, solutions and all)
            for s in ("train", "validation"):
                for row in self._table.rows(s) if s in self._table.splits() else ():
                    known[_normal(row.get("question", ""))] = row.get("difficulty")
            return [_with_difficulty(e, known.get(_question(e))) for e in test]
        held_out = {_question(e) for e in test}
        examples = self._examples(self._table, split)
        return take(examples, [i for i, e in enumerate(examples) if _question(e) not in held_out])

    def _test_references(self, split: str) -> bool:
        """Whether ``test_path``'s examples take R1 references: with ``reference_solutions``, where its rows have
        the solution columns (a test file in trl-lib's schema, which has none, failed every split's load)."""
        if not self.reference_solutions:
            return False
        if "_test_refs" not in self.__dict__:  # once: load runs for each split
            rows = self._test_table.rows(split)
            self._test_refs = not rows or any(k in rows[0] for k in SOLUTIONS)
            if not self._test_refs:
                log.warning("DeepMath test_path %s has no %s: its examples' references are their answers",
                            self.test_path, "/".join(SOLUTIONS))  # fmt: skip
        return self._test_refs

    def _examples(self, table: SplitTable, split: str, references: bool | None = None) -> Sequence[Example]:
        rows = table.rows(split)  # checked against SCHEMAS; a parquet or hub source stays memory-mapped
        references = self.reference_solutions if references is None else references
        make = functools.partial(make_example, self.template, references, table.path)
        return Mapped(rows, make) if is_lazy(rows) else [make(row) for row in rows]

    def _uid(self, row: Mapping) -> str:
        """The authors' id of a row's prompt (``tasks.holdout.prompt_uid`` of the system and user messages)."""
        return prompt_uid(self.system_prompt, fill(self.template, question=_row_text(row)[0]))



def make_example(template: str, reference_solutions: bool, source: str, row: Mapping) -> Example:
    """A DeepMath row's example: the ``template``'s user message, the gold answer, the difficulty and metadata (with
    ``reference_solutions``, ``metadata["reference"]``: the shortest final text of ``r1_solution_1..3``)."""
    question, answer = _row_text(row, source)
    difficulty = row.get("difficulty")
    metadata = {"topic": row.get("topic") or "", "source": source, "question": str(question)}
    if reference_solutions:
        metadata["reference"] = _shortest_final_text(row, source)
    return Example(
        prompt=[{"role": "user", "content": fill(template, question=question)}],  # after the system prompt
        answer=str(answer).strip(),
        difficulty=None if is_blank(difficulty) else float(difficulty),
        metadata=metadata,
    )


def _row_text(row: Mapping, source: str = "a row") -> tuple[str, object]:
    """The question of a row of either schema, stripped of surrounding whitespace as the paper's authors strip it,
    and its gold answer."""
    if "question" in row:
        return str(row["question"]).strip(), row["final_answer"]
    return str(_last_user_message(row["prompt"], source)).strip(), row["solution"]


def _shortest_final_text(row: Mapping, source: str) -> str:
    """The shortest non-empty ``final_text`` of ``r1_solution_1..3`` (the first on a tie), else ``final_answer``."""
    texts = [text for k in SOLUTIONS if not is_blank(row.get(k)) and (text := final_text(str(row[k])))]
    if not texts and "final_answer" not in row:
        raise ValueError(f"{source}: reference_solutions needs the columns {', '.join(SOLUTIONS)} (zwhe99's schema); "
                         f"a row has none: {str(row.get('question'))[:80]!r}")  # fmt: skip
    return min(texts, key=len) if texts else str(row["final_answer"]).strip()


def _row_question(row: Mapping) -> str:
    """The question of a row of either schema, whitespace-normalised: the key of the hash holdout."""
    return _normal(row["question"] if "question" in row else _last_user_message(row["prompt"], "a row"))


def _last_user_message(messages: object, source: str) -> str:
    users = [m.get("content", "") for m in messages or [] if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        raise ValueError(f"{source}: a 'prompt' holds no user message: {messages!r}")
    return users[-1]


def _normal(question: str) -> str:
    return " ".join(str(question).split())


def _question(example: Example) -> str:
    return _normal(example.metadata["question"])


def _with_difficulty(example: Example, difficulty: object) -> Example:
    if example.difficulty is not None or is_blank(difficulty):
        return example
    return dataclasses.replace(example, difficulty=float(difficulty))
