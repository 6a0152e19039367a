"""OpenThoughts3 (``open-thoughts/OpenThoughts3-1.2M``: difficulty, source, domain, conversations): reasoning
traces, learned by similarity to the reference and a think-then-answer format (the SoftmaxGRPO paper)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from sgrpo.checks import require
from sgrpo.lazy import Mapped, is_lazy
from sgrpo.types import Example
from tasks.base import Task
from tasks.data import Schema
from tasks.holdout import check_holdout, check_size, paper_carver, prompt_uid
from tasks.lazy_table import LazySplitTable
from tasks.paper import OPENTHOUGHTS_SYSTEM_PROMPT
from tasks.reward import Reward, RewardResult, WeightedSum, check_batch
from tasks.similarity import WordSimilarity
from tasks.think_format import ThinkFormat


def conversation_problem(value: object) -> str:
    """The data ``Check`` of ``conversations``: "" for ``{from, value}`` turns with a human and a gpt turn of text."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
        return f"is not a list of {{from, value}} turns ({str(value)[:80]!r})"
    for speaker in ("human", "gpt"):
        if not any(m.get("from") == speaker and str(m.get("value") or "").strip() for m in value):
            return f"holds no {speaker!r} turn with text"
    return ""


SCHEMA = Schema(("conversations",), {"conversations": conversation_problem}, "the OpenThoughts schema")


def default_reward() -> WeightedSum:
    """The paper's reward: 0.65 x ``WordSimilarity`` to the reference + 0.35 x ``ThinkFormat``."""
    return WeightedSum([WordSimilarity(), ThinkFormat()], weights=[0.65, 0.35], name="openthoughts")


class OpenThoughts(Task):
    """OpenThoughts3: the human turn as the user message after the paper's ``system_prompt`` (which asks for the
    reasoning in ``<think> </think>`` and the answer after it) -> ``answer``: the (last) gpt turn, the reference.

    The hub set has a train split only: validation and test are held out by ``tasks.holdout.hash_holdout``
    (distinct human turns ranked by a hash of ``seed`` and the turn, at most 10 %; 1,000 and seed 42 by default);
    ``holdout="paper"`` holds out the authors' prompts instead (``tasks.holdout.paper_holdout`` over the ids of the
    system and user messages; the paper's 500, seed 42).
    ``Example.difficulty`` is the row's ``difficulty`` and ``metadata`` has its ``domain`` and ``source``.
    Reward: ``default_reward()``. There is no verifier: success is the training reward reaching
    ``success_threshold`` (graded once with the reward), so ``val/accuracy`` is the share of completions whose
    reward reaches it (the engine's validation logs success only, not the mean reward).
    """

    def __init__(
        self,
        path: str = "open-thoughts/OpenThoughts3-1.2M",
        system_prompt: str | None = OPENTHOUGHTS_SYSTEM_PROMPT,
        validation_size: int | float = 1000,
        test_size: int | float = 0,
        seed: int = 42,
        reward: Reward | None = None,
        success_threshold: float = 0.5,
        holdout: Literal["hash", "paper"] = "hash",
        **settings,
    ) -> None:
        super().__init__(reward or default_reward(), system_prompt=system_prompt, **settings)
        check_size(validation_size, "validation_size")
        check_size(test_size, "test_size")
        check_holdout(holdout, validation_size, test_size)
        require(0.0 < success_threshold <= 1.0, f"success_threshold must be in (0, 1], got {success_threshold}")
        self.path, self.seed, self.success_threshold = path, seed, success_threshold
        sizes = {"validation": validation_size, "test": test_size}
        columns = ("conversations", "difficulty", "domain", "source")
        uid = lambda row: prompt_uid(self.system_prompt, _turn(row, "human"))  # noqa: E731
        carve = paper_carver(uid) if holdout == "paper" else None
        self.holdout = holdout
        self._table = LazySplitTable(path, None, columns, SCHEMA, sizes, seed, group=_human_turn, carve=carve)

    def load(self, split: str) -> Sequence[Example]:
        rows = self._table.rows(split)  # a parquet or hub source: memory-mapped, each example built when read
        return Mapped(rows, _example) if is_lazy(rows) else [_example(row) for row in rows]

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> RewardResult:
        result = self.reward.score(examples, completions)
        return RewardResult(result.total, result.parts, result.failures, result.counts, self._reached(result.total))

    def successes(self, examples: Sequence[Example], completions: Sequence[str]) -> Tensor:
        check_batch(examples, completions)
        return self._reached(self.reward.score(examples, completions).total)

    def success(self, example: Example, completion: str) -> bool:
        return bool(self.successes([example], [completion])[0])

    def _reached(self, total: Tensor) -> Tensor:
        return total >= self.success_threshold - 1e-9  # a float: a tensor would take bf16-true's default dtype


def _example(row: Mapping) -> Example:
    metadata = {"domain": row.get("domain") or "", "source": row.get("source") or ""}
    prompt = [{"role": "user", "content": _turn(row, "human")}]
    return Example(prompt, _turn(row, "gpt"), row.get("difficulty"), metadata)


def _human_turn(row: Mapping) -> str:
    return _turn(row, "human")


def _turn(row: Mapping, speaker: str) -> str:
    """The text of the last ``speaker`` turn (rows are checked: there is one)."""
    return [str(m["value"]) for m in row["conversations"] if m.get("from") == speaker][-1]
