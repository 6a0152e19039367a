"""Text-similarity rewards in [0, 1] against ``Example.answer``: exact match, chrF, BLEU, ROUGE-L, edit, and
the SoftmaxGRPO paper's word similarity (``WordSimilarity``: 0.6 word F1 + 0.4 word ROUGE-L F1).

Every metric is a library call (sacrebleu, rouge-score, rapidfuzz) scaled to [0, 1]. Before scoring,
a completion loses its ``<think>`` block and surrounding whitespace (``WordSimilarity``: keeps its
``final_text``); an empty answer scores 0 (a guard against degenerate outputs). With ``normalize=True``
both sides are label-normalised first (lowercase, a leading "Answer:" dropped, "&" -> "and", punctuation
removed).
"""

from __future__ import annotations

import re
import string
from abc import abstractmethod
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

from rapidfuzz.distance import Indel, LCSseq, Levenshtein

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


#: chat end markers ``final_text`` deletes (a completion decoded with its special tokens may end with one)
END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def final_text(completion: str) -> str:
    """The text the SoftmaxGRPO paper's rewards grade (its authors' rule, on completions and references alike):

    1. every ``<|im_end|>`` and ``<|endoftext|>`` deleted, whitespace stripped;
    2. if a ``</think>`` remains, only what follows the last one, stripped (a think block never closed is kept);
    3. the answer blocks are read left to right, each from an ``<answer>`` to the first ``</answer>`` after it
       (so ``<answer>a<answer>b</answer>`` reads ``a<answer>b``); the last one's content, else the text;
    4. stripped.

    ``"<think>a</think> so <answer> 7 </answer>"`` -> ``"7"``; ``"<think>cut off"`` -> ``"<think>cut off"``.
    """
    text = str(completion)
    for marker in END_MARKERS:
        text = text.replace(marker, "")
    text = text.strip()
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1].strip()
    last, position = None, 0
    while (start := text.find("<answer>", position)) >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        last, position = text[start + len("<answer>") : end], end + len("</answer>")
    return (text if last is None else last).strip()


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
        from sacrebleu.metrics import CHRF  # imported here: a task without chrF does not load sacrebleu

        self.word_order = word_order
        self._metric = CHRF(word_order=word_order)

    def similarity(self, prediction: str, reference: str) -> float:
        return self._metric.sentence_score(prediction, [reference]).score / 100.0


class Bleu(TextSimilarity):
    """sacrebleu sentence BLEU / 100 with ``effective_order`` (poor on very short texts)."""

    name = "bleu"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from sacrebleu.metrics import BLEU  # imported here: a task without BLEU does not load sacrebleu

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


_ARTICLE = re.compile(r"\b(?:a|an|the)\b")


def normalize_words(text: str) -> list[str]:
    """SQuAD-style words, the SoftmaxGRPO paper's: lower-cased, ASCII punctuation deleted, then every whole word
    "a", "an" or "the" (word boundaries as Python's ``re`` draws them: ``"the—cat"`` loses its "the") replaced
    by a space, then split on whitespace.

    ``"The cat's 2.5 mats, a dog."`` -> ``["cats", "25", "mats", "dog"]``.
    """
    return _ARTICLE.sub(" ", _PUNCTUATION.sub("", text.lower())).split()


def word_f1(prediction: list[str], reference: list[str]) -> float:
    """F1 of the word multisets: overlap c = sum over words of min(count in prediction, count in reference),
    P = c / |prediction|, R = c / |reference|, F1 = 2PR / (P + R); 0 when either is empty or c = 0."""
    common = sum((Counter(prediction) & Counter(reference)).values())
    return 0.0 if common == 0 else 2.0 * common / (len(prediction) + len(reference))


def word_rouge_l(prediction: list[str], reference: list[str]) -> float:
    """ROUGE-L F1 over words: l = the longest common subsequence's length, P = l / |prediction|,
    R = l / |reference|, F = 2PR / (P + R) = 2l / (|prediction| + |reference|); 0 when either is empty."""
    if not prediction or not reference:
        return 0.0
    return 2.0 * LCSseq.similarity(prediction, reference) / (len(prediction) + len(reference))


class WordSimilarity(TextSimilarity):
    """The SoftmaxGRPO paper's similarity reward: ``f1_weight x F1 + (1 - f1_weight) x ROUGE-L F1`` (0.6 / 0.4)
    over ``normalize_words`` of the completion's ``final_text`` against the reference; 0 if either side has no
    words.

    The reference is ``example.metadata[reference]`` when ``reference`` names a key (GSM8K's ``solution``),
    else ``example.metadata["reference"]`` when the task gives one (DeepMath with ``reference_solutions``,
    Countdown-GOLD), else ``example.answer`` (OpenThoughts, and every reference-text task). So it works with
    any task that has a reference text. The reference is read by its own ``final_text`` too, as the paper's
    authors read it (``reference_final_text``, default True): a reference that is a whole reasoning trace
    (OpenThoughts' assistant turn, Countdown-GOLD's assistant message) is compared by its answer part, so a
    completion that thinks and then gives the reference's answer scores 1. False compares with the whole text.
    ``normalize`` is not used (the words are always normalised).
    """

    name = "similarity"

    def __init__(
        self, f1_weight: float = 0.6, reference: str | None = None, reference_final_text: bool = True, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        require(0.0 <= f1_weight <= 1.0, f"f1_weight must be in [0, 1], got {f1_weight}")
        self.f1_weight, self.reference, self.reference_final_text = f1_weight, reference, reference_final_text

    def reference_text(self, example: Example) -> str:
        """The text a completion to ``example`` is compared with (a missing named key raises: a failed scoring)."""
        if self.reference is not None:
            text = str(example.metadata[self.reference])
        else:
            text = str(example.metadata.get("reference", example.answer))
        return final_text(text) if self.reference_final_text else text

    def score_one(self, example: Example, completion: str) -> float:
        return self.similarity(final_text(completion), self.reference_text(example))

    def similarity(self, prediction: str, reference: str) -> float:
        words, gold = normalize_words(prediction), normalize_words(reference)
        return self.f1_weight * word_f1(words, gold) + (1.0 - self.f1_weight) * word_rouge_l(words, gold)
