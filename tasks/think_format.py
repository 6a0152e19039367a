"""The OpenThoughts format reward of the SoftmaxGRPO paper: one closed think block, then an answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sgrpo.types import Example
from tasks.reward import SampleReward
from tasks.similarity import template_opens_think


def think_format(completion: str) -> tuple[float, str]:
    """1 if ``completion`` has exactly one ``<think>`` and one ``</think>``, starts with ``<think>`` (after
    whitespace), and both the thought (between the tags) and the answer (after ``</think>``) hold more than
    whitespace; else 0. With the label of the outcome: "ok", "tags" (tag count or start), "empty_thought",
    "empty_answer".

    ``"<think>x</think> 4"`` -> 1; ``"<think>x</think>"``, ``"4 <think>x</think> 4"``,
    ``"<think><think>x</think> 4"`` -> 0.
    """
    text = completion.lstrip()
    if completion.count("<think>") != 1 or completion.count("</think>") != 1 or not text.startswith("<think>"):
        return 0.0, "tags"
    thought, answer = text[len("<think>") :].split("</think>")
    if not thought.strip():
        return 0.0, "empty_thought"
    return (1.0, "ok") if answer.strip() else (0.0, "empty_answer")


class ThinkFormat(SampleReward):
    """``think_format`` of each completion, in {0, 1} (``scale`` "pm1": -1 / +1); the example is not read.

    Where the chat template opens the ``<think>`` block in the prompt (DeepSeek-R1-Distill's does:
    ``adapt_to_tokenizer``), a completion starts inside it and is read after that ``<think>``: every completion
    scored 0 there, its opening tag being the prompt's (found by a review)."""

    name = "format"
    opened = False  # the chat template opens <think> in the prompt (adapt_to_tokenizer)

    def adapt_to_tokenizer(self, tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.opened = template_opens_think(tokenizer, chat_template_kwargs)

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        return think_format("<think>" + completion if self.opened else completion)
