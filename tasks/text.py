"""Reference-text tasks: a prompt, a reference text, a similarity reward and a separate success test."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

from sgrpo.checks import require
from sgrpo.types import Example, Messages
from tasks.base import Task
from tasks.data import Schema, SplitTable, not_blank
from tasks.reward import Reward
from tasks.similarity import ChrF, ExactMatch, TextSimilarity


class ReferenceTextTask(Task):
    """Base class: rows of a table -> ``Example(prompt, answer=reference)``, scored by text similarity.

    Subclasses give ``required_columns`` (and ``optional_columns``), ``nonblank_columns`` (those of
    them that must hold text: a row with a blank reference fails at load, naming file, row and column)
    and ``make_example(row)``.
    Splits the source lacks are held out of its train rows with ``seed`` (``validation_size``,
    ``test_size``: a count or a fraction).
    ``chat=True`` wraps the prompt text as one user message (after ``system_prompt``, when set); ``False``
    feeds it as raw text.
    Success: ``success_metric(completion, reference) >= success_threshold`` on [0, 1]; the default,
    ``ExactMatch(normalize=True)`` with threshold 1, is normalised exact match. ``settings``: ``Task``'s.
    """

    required_columns: tuple[str, ...] = ()
    optional_columns: tuple[str, ...] = ()  # read when present
    nonblank_columns: tuple[str, ...] = ()  # required columns that must not be empty or whitespace
    column_hint: str = ""  # how to fix a source that lacks a required column (goes into the error)

    def __init__(
        self,
        path: str,
        reward: Reward,
        config: str | None = None,
        validation_size: int | float = 0.1,
        test_size: int | float = 0.1,
        seed: int = 0,
        chat: bool = True,
        success_metric: TextSimilarity | None = None,
        success_threshold: float = 1.0,
        **settings,
    ) -> None:
        super().__init__(reward, **settings)
        require(
            chat or not self.system_prompt, "system_prompt needs chat prompts: set chat: true, or system_prompt: null"
        )
        require(0.0 < success_threshold <= 1.0, f"success_threshold must be in (0, 1], got {success_threshold}")
        self.path, self.seed, self.chat = path, seed, chat
        self.success_metric = success_metric or ExactMatch(normalize=True)
        self.success_threshold = success_threshold
        sizes = {"validation": validation_size, "test": test_size}
        columns = (self.required_columns + self.optional_columns) or None
        schema = Schema(self.required_columns, {c: not_blank for c in self.nonblank_columns}, hint=self.column_hint)
        self._table = SplitTable(path, config, columns, schema, sizes, seed)

    def load(self, split: str) -> Sequence[Example]:
        return [self.make_example(row) for row in self._table.rows(split)]

    @abstractmethod
    def make_example(self, row: Mapping) -> Example:
        """The example of one row (its columns are checked)."""

    def as_prompt(self, text: str) -> str | Messages:
        """``text`` as one user message (``chat``) or as is."""
        return [{"role": "user", "content": text}] if self.chat else text

    @property
    def success_grader(self) -> TextSimilarity:
        """Success: ``success_metric`` >= ``success_threshold`` (failed scorings: False); graded once with a reward
        that grades alike (MeetingBank's and PoetryWriting's defaults)."""
        return self.success_metric


class ReferenceText(ReferenceTextTask):
    """Any table with a prompt column and a reference column; reward ``ChrF()`` by default."""

    def __init__(
        self,
        path: str,
        prompt_field: str = "prompt",
        reference_field: str = "reference",
        reward: Reward | None = None,
        **kwargs,
    ) -> None:
        self.required_columns = (prompt_field, reference_field)
        self.nonblank_columns = (prompt_field, reference_field)
        self.column_hint = "set prompt_field= and reference_field= to the columns that hold them"
        self.prompt_field, self.reference_field = prompt_field, reference_field
        super().__init__(path, reward or ChrF(), **kwargs)

    def make_example(self, row: Mapping) -> Example:
        return Example(self.as_prompt(str(row[self.prompt_field])), str(row[self.reference_field]).strip())
