"""Poetry (``merve/poetry``: author, content, poem name, age, type), read two ways (H1, H2 below).

The SoftmaxGRPO abstract (arXiv 2608.09271) reports a 1.5B instruct model going from 35.0 % to
68.0 % on "Poetry" with text-similarity rewards; the exact task is not public. H1
(``PoetryClassification``): name the poem's ``type`` (or ``age``), rewarded by chrF of the normalised
label, success = normalised exact match. H2 (``PoetryWriting``): write the poem from its title and
author, rewarded by chrF against the text, success = chrF >= 0.5. The set has one split (~573 rows):
validation and test are held out by seed. Settings not listed in a class's signature (``validation_size``,
``seed``, ``chat``, ``success_metric``, ...) are those of ``ReferenceTextTask``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.base import check_template, fill
from tasks.reward import Reward
from tasks.similarity import ChrF, TextSimilarity
from tasks.text import ReferenceTextTask

CLASSIFY_TEMPLATES = {
    "type": "Read the poem below and classify its subject. Answer with exactly one of: {choices}.\n\n"
    "Poem:\n{content}\n\nAnswer:",
    "age": "Read the poem below and classify the period it was written in. Answer with exactly one of: "
    "{choices}.\n\nPoem:\n{content}\n\nAnswer:",
}
WRITE_TEMPLATE = 'Write the poem "{title}" by {author}.'
_COLUMNS = ("author", "content", "poem name", "age", "type")


def _fields(row: Mapping) -> dict[str, str]:
    """The row's columns as template fields ({author}, {content}, {title}, {age}, {type})."""
    return {
        "author": str(row["author"]).strip(),
        "content": str(row["content"]).strip(),
        "title": str(row["poem name"]).strip(),
        "age": str(row["age"]).strip(),
        "type": str(row["type"]).strip(),
    }


class PoetryClassification(ReferenceTextTask):
    """H1: poem -> its ``label`` column (``type``: Love / Nature / Mythology & Folklore, or ``age``).

    ``template`` placeholders: {choices} (``choices``, default: the labels found in the data, sorted),
    {content}, {author}, {title}. Reward ``ChrF(normalize=True)``: chrF / 100 of the normalised labels
    (lowercase, "Answer:" and punctuation dropped, "&" -> "and"). Success: normalised exact match.
    """

    required_columns = _COLUMNS

    def __init__(
        self,
        path: str = "merve/poetry",
        label: Literal["type", "age"] = "type",
        choices: list[str] | None = None,
        template: str | None = None,
        reward: Reward | None = None,
        test_size: int | float = 0.2,
        **settings,
    ) -> None:
        require(label in CLASSIFY_TEMPLATES, f"label must be one of {sorted(CLASSIFY_TEMPLATES)}, got {label!r}")
        self.label, self.choices = label, choices
        self.nonblank_columns = ("content", label)
        self.template = CLASSIFY_TEMPLATES[label] if template is None else template
        check_template(self.template, ["content"])
        super().__init__(
            path=path,
            reward=reward or ChrF(normalize=True),
            test_size=test_size,
            **settings,
        )

    def load(self, split: str) -> Sequence[Example]:
        if self.choices is None:
            rows = [row for s in self._table.splits() for row in self._table.rows(s)]
            self.choices = sorted({str(row[self.label]).strip() for row in rows if row.get(self.label)})
        return super().load(split)

    def make_example(self, row: Mapping) -> Example:
        fields = _fields(row)
        text = fill(self.template, choices=", ".join(self.choices or []), **fields)
        return Example(self.as_prompt(text), fields[self.label], metadata={"title": fields["title"]})


class PoetryWriting(ReferenceTextTask):
    """H2: title and author -> the poem's text, rewarded by chrF / 100; success: chrF >= 0.5.

    ``template`` placeholders: {title}, {author} (and {age}, {type}).
    """

    required_columns = _COLUMNS
    nonblank_columns = ("content",)

    def __init__(
        self,
        path: str = "merve/poetry",
        template: str = WRITE_TEMPLATE,
        reward: Reward | None = None,
        test_size: int | float = 0.2,
        success_metric: TextSimilarity | None = None,
        success_threshold: float = 0.5,
        **settings,
    ) -> None:
        check_template(template, ["title"])
        self.template = template
        super().__init__(
            path=path,
            reward=reward or ChrF(),
            test_size=test_size,
            success_metric=success_metric or ChrF(),
            success_threshold=success_threshold,
            **settings,
        )

    def make_example(self, row: Mapping) -> Example:
        fields = _fields(row)
        text = fill(self.template, **fields)
        return Example(self.as_prompt(text), fields["content"], metadata={"type": fields["type"]})
