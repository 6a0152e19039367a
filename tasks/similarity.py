"""Text-similarity rewards in [0, 1] against ``Example.answer``: exact match, chrF, BLEU, ROUGE-L, edit.

Every metric is a library call (sacrebleu, rouge-score, rapidfuzz) scaled to [0, 1]. Before scoring,
a completion loses its ``<think>`` block and surrounding whitespace; an empty answer scores 0 (a
guard against degenerate outputs). With ``normalize=True`` both sides are label-normalised first
(lowercase, a leading "Answer:" dropped, "&" -> "and", punctuation removed).
"""

from __future__ import annotations

import re
import string
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, Literal

from rapidfuzz.distance import Indel, Levenshtein
from sacrebleu.metrics import BLEU, CHRF

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.reward import SampleReward, Scale

_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")
_ANSWER_PREFIX = re.compile(r"^\s*(final\s+)?answer\s*[:\-]\s*", re.IGNORECASE)


def strip_think(text: str) -> str:
    """The answer part of a completion: the text after the last ``</think>``.

    A completion that opens ``<think>`` and never closes it (cut off while thinking) has no answer: "".
    """
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    return "" if text.lstrip().startswith("<think>") else text


def template_opens_think(tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> bool:
    """Does ``tokenizer``'s chat template open a ``<think>`` block in the prompt, as DeepSeek-R1-Distill's does?

    Then every completion starts inside that block, so one cut off while thinking carries neither tag.
    False for a tokenizer without a chat template, and for one that opens and closes the block (thinking off,
    as Qwen3's does with ``chat_template_kwargs={"enable_thinking": False}``: rendered as the rollout renders).
    """
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "1 + 1 = ?"}]
    kwargs = dict(chat_template_kwargs or {})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def normalize_label(text: str) -> str:
    """``"Answer: Mythology & Folklore."`` -> ``"mythology and folklore"``."""
    text = _ANSWER_PREFIX.sub("", text).replace("&", " and ").lower()
    return " ".join(_PUNCTUATION.sub(" ", text).split())


class TextSimilarity(SampleReward):
    """Base class: ``similarity(prediction, reference)`` in [0, 1] of the prepared texts.

    ``prepare`` strips the think block and whitespace (and label-normalises when ``normalize``);
    an empty prediction scores 0. Scale, workers and timeout are those of ``SampleReward``.
    """

    name = "similarity"

    def __init__(
        self,
        normalize: bool = False,
        scale: Scale = "01",
        name: str | None = None,
        workers: int = 0,
        timeout: float = 10.0,
    ) -> None:
        super().__init__(scale=scale, name=name, workers=workers, timeout=timeout)
        self.normalize = normalize

    def prepare(self, text: str) -> str:
        """The text that is compared: think block and whitespace removed, normalised if asked."""
        text = strip_think(text).strip()
        return normalize_label(text) if self.normalize else text

    def score_one(self, example: Example, completion: str) -> float:
        prediction, reference = self.prepare(completion), self.prepare(example.answer)
        return self.similarity(prediction, reference) if prediction else 0.0

    @abstractmethod
    def similarity(self, prediction: str, reference: str) -> float:
        """Similarity in [0, 1] of two prepared, non-empty-prediction texts."""


class ExactMatch(TextSimilarity):
    """1 if the prepared prediction equals the prepared reference, else 0 (binary)."""

    name = "exact_match"

    def similarity(self, prediction: str, reference: str) -> float:
        return float(prediction == reference)


class ChrF(TextSimilarity):
    """sacrebleu sentence chrF / 100 (character 6-grams, beta = 2; ``word_order=2`` gives chrF++)."""

    name = "chrf"

    def __init__(self, word_order: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        require(word_order >= 0, f"word_order must be >= 0 (0: chrF, 2: chrF++), got {word_order}")
        self.word_order = word_order
        self._metric = CHRF(word_order=word_order)

    def similarity(self, prediction: str, reference: str) -> float:
        return self._metric.sentence_score(prediction, [reference]).score / 100.0


class Bleu(TextSimilarity):
    """sacrebleu sentence BLEU / 100 with ``effective_order`` (poor on very short texts)."""

    name = "bleu"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._metric = BLEU(effective_order=True)

    def similarity(self, prediction: str, reference: str) -> float:
        return min(1.0, self._metric.sentence_score(prediction, [reference]).score / 100.0)


class RougeL(TextSimilarity):
    """rouge-score ROUGE-L F1 (already in [0, 1]). Its default tokenizer drops non-ASCII text."""

    name = "rougeL"

    def __init__(self, use_stemmer: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        from rouge_score import rouge_scorer  # imported here: it loads nltk (about 1.4 s)

        self.use_stemmer = use_stemmer
        self._scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)

    def similarity(self, prediction: str, reference: str) -> float:
        return self._scorer.score(reference, prediction)["rougeL"].fmeasure  # (target, prediction)


class EditSimilarity(TextSimilarity):
    """rapidfuzz normalised similarity, ``1 - distance / max distance``: Levenshtein or Indel."""

    name = "edit"

    def __init__(self, metric: Literal["levenshtein", "indel"] = "levenshtein", **kwargs) -> None:
        super().__init__(**kwargs)
        require(metric in ("levenshtein", "indel"), f"metric must be 'levenshtein' or 'indel', got {metric!r}")
        self.metric = metric

    def similarity(self, prediction: str, reference: str) -> float:
        distance = Levenshtein if self.metric == "levenshtein" else Indel
        return distance.normalized_similarity(prediction, reference)
