"""Math answer checking: the last ``\\boxed{}`` graded by math-verify, and a cheap numeric check.

``grade_math`` follows the DeepMath recipe (the DeepMath authors' reward; README, Tasks): grade only the text after
``</think>`` (none without it, under ``require_think``), compare the last box (every box, for a gold of
several parts) with the gold answer by math-verify with the gold FIRST (``verify`` is asymmetric), both
respelt alike first (``tasks.mathnotation``), and a gold printed as a rounded decimal at its printed
precision. A cheap normalised string comparison runs first: it settles exact spellings without sympy
and is the only check for Yes/No answers (math-verify parses "Yes" as the product E*s*y).

Adversarial answers must not stall training: the cheap checks and the deadline of ``tasks.mathguard``
run before and around sympy, so ``MathVerifyReward`` grades in worker processes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from sympy import Basic

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.mathguard import MAX_ANSWER_CHARS, MAX_DIGITS, _Deadline, _deadline, _log10_bound, reject_box
from tasks.mathnotation import PrintedDecimal, normalize_answer, respell, several_parts
from tasks.reward import SampleReward, Scale
from tasks.similarity import final_text, strip_think, template_opens_think

#: a number in free text: a minus sign only where no word, digit or bracket comes just before it ("3-4" is a range or
#: a difference, not -4), and an exponent ("1.5e3" is 1500, not 3)
#: U+2212, the minus sign of typeset text: read as "-" (as math-verify reads it), or "−18" was 18 and right against 18
MINUS_SIGN = "\u2212"
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
#: a comma between a digit and three more groups them (``1,000``); any other separates (``(2,-5)``: -5, not the
#: range ``2-5``; ``3,-4,5``: 5)
_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
#: a LaTeX relation or operator, after which a minus is a sign (``x \approx-3``; ``\pi-3`` stays a difference)
_COMMAND = re.compile(r"\\(?:approx|simeq|sim|equiv|leq|le|geq|ge|neq|ne|to|times|cdot|div|pm|mp)(?![A-Za-z])")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
#: a box's content read as one number (``numeric_answer``): a signed decimal, then at most words (units) and a period
_BOX_NUMBER = re.compile(
    r"(?:[A-Za-z][A-Za-z\s]*=)?\s*\+?(-?\s*(?:\d+(?:\.\d*)?|\.\d+))\s*(?:[A-Za-z(][A-Za-z\s/()'.]*)?\.?"
)
#: what a box holds around its number that is no number: wrappers (their text kept), spacing, degrees, unit powers
_WRAPPER = re.compile(
    r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mathit|boldsymbol|mbox|operatorname)\s*\{([^{}]*)\}"
)
_LAYOUT = re.compile(r"\\(?:displaystyle|textstyle|left|right|quad|qquad|[;:!, ])|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_UNIT_POWER = re.compile(
    r"(?<![A-Za-z])((?:cm|mm|km|m|in|ft|yd|mi|units?|meters?|metres?|feet|inches))\s*\^\s*\{?[23]\}?"
)
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:\{,\}|,|\\[,!]|\\ )(?=\d{3}(?!\d))")  # 1,000 1{,}000 1\,000 1\!000
_FRACTION = re.compile(r"\s*(-?)\s*\\[dt]?frac\{(\d+)\}\{(\d+)\}\s*|\s*(-?\d+)\s*/\s*(\d+)\s*")
_YES_NO = {"yes", "no"}
#: math-verify's deadline for one answer, in seconds of CPU time, as a fraction of the reward's ``timeout`` (the
#: pool's wall-clock limit per answer). The wall limit is 4 times the CPU deadline so that load alone does not
#: reach it: a worker that gets a quarter of a core still ends a costly answer at its own deadline (a score of 0)
#: before the pool kills it (a restart), and a correct answer (~0.1 s of CPU) is cut only by a starvation of
#: 1/25 of a core at the default 10 s. The wall limit remains for what spends no CPU (a hang, a blocked call).
DEADLINE_FRACTION = 0.25


def _box_end(text: str, open_brace: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_brace``, or None if it never closes."""
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def _box_at(text: str, after: int) -> tuple[str, int] | None:
    """The argument of the box command ending at ``after`` and the index past it: ``{...}`` with balanced braces,
    or, without a brace, the token that follows (``\\boxed 5``, as TeX reads it: not a brace further on, which
    graded ``\\boxed 5 ... \\frac{10}{2}`` as 10); None when the braces never close (cut off) or nothing follows."""
    start = len(text) - len(text[after:].lstrip())
    if start < len(text) and text[start] == "{":
        end = _box_end(text, start)
        return None if end is None else (text[start + 1 : end], end + 1)
    token = re.match(r"[^\s${}\\]+", text[start:])
    return None if token is None else (token.group().rstrip("."), start + token.end())


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    last = _last_box(text)
    found = None if last is None else _box_at(text, last.end())
    return None if found is None else found[0]  # None when unbalanced: the box was cut off


def _last_box(text: str) -> re.Match | None:
    """The last box command of ``text`` (``\\boxed`` or ``\\fbox``), else None."""
    matches = list(_BOX.finditer(text))
    return matches[-1] if matches else None


def all_boxed(text: str) -> list[str]:
    """Contents of every outermost ``\\boxed{...}`` (or ``\\fbox{...}``), in order, up to one cut off."""
    boxes, position = [], 0
    while match := _BOX.search(text, position):
        found = _box_at(text, match.end())
        if found is None:  # cut off: every later box lies inside it
            break
        boxes.append(found[0])
        position = found[1]
    return boxes


def graded_box(answer: str, gold: str) -> str | None:
    """The box ``grade_math`` grades: the last one; every box, joined by commas, for a gold of several parts."""
    if not several_parts(gold):
        return last_boxed(answer)
    boxes = all_boxed(answer)
    return ", ".join(boxes) if boxes else None


def grade_math(
    gold: str,
    response: str,
    require_box: bool = True,
    timeout: float | None = 5.0,
    max_answer_chars: int = MAX_ANSWER_CHARS,
    require_think: bool = False,
    final: bool = False,
) -> tuple[float, str]:
    """1.0 if ``response`` answers ``gold``, else 0.0, with a label for the outcome.

    The answer graded is the text after ``</think>`` (none when a ``<think>`` opened at the start never closes);
    with ``final``, the SoftmaxGRPO paper's ``final_text`` instead (after the last ``</think>``, else the whole
    completion; then the last ``<answer>...</answer>``'s content).

    Labels: "correct", "wrong", "unclosed_think" (``require_think`` and no ``</think>``), "no_box" (no
    ``\\boxed{}`` after the think block), "unparsed" (math-verify extracted nothing from the answer), and the
    cheap rejections "too_long", "junk", "too_complex" (``tasks.mathguard``; a box spelt exactly like the
    gold is never rejected). ``require_box=False`` grades the whole answer text when there is no box (then
    only the parsed-size check applies). Raises ``ValueError`` if the gold answer itself does not parse (a
    data problem) and ``TimeoutError`` if the grading spends over ``timeout`` seconds of CPU time (fractions
    allowed; ``tasks.mathguard._deadline``: CPU, not wall time, so that a loaded machine does not cut a correct
    answer; enforced on the main thread only, ``None`` disables it).
    """
    if require_think and "</think>" not in response:
        return 0.0, "unclosed_think"
    answer = final_text(response) if final else strip_think(response)
    box = graded_box(answer, gold)
    if box is None and require_box:
        return 0.0, "no_box"
    target, reference = normalize_answer(answer if box is None else box), normalize_answer(gold)
    if reference.lower() in _YES_NO:  # case-insensitive string check only
        return (1.0, "correct") if target.lower() == reference.lower() else (0.0, "wrong")
    if target == reference:
        return 1.0, "correct"
    if box is not None:
        rejected = reject_box(box, max_answer_chars)
        if rejected:
            return 0.0, rejected
    try:
        with _deadline(timeout):
            return _verify(gold, answer if box is None else f"\\boxed{{{box}}}")
    except _Deadline:
        raise TimeoutError(f"math-verify grading took over {timeout:g} s of CPU time") from None


def _verify(gold: str, target: str) -> tuple[float, str]:
    gold_parsed, printed = _parse_gold(gold)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} does not parse")
    predicted = parse(respell(target), parsing_timeout=None)
    if not predicted:
        return 0.0, "unparsed"
    if any(isinstance(p, Basic) and _log10_bound(p) > MAX_DIGITS for p in predicted):
        return 0.0, "too_complex"
    # math-verify rounds floats to 6 places: never looser than the places the gold is printed with
    rounding = 6 if printed is None else max(6, -printed.place)
    correct = verify(list(gold_parsed), predicted, float_rounding=rounding, timeout_seconds=None)
    if not correct and printed is not None and printed.rounded:
        correct = printed.matches(predicted)
    return (1.0, "correct") if correct else (0.0, "wrong")


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[tuple, PrintedDecimal | None]:
    # a group of G completions shares one gold answer: parse it once per process
    return tuple(parse(f"${respell(gold)}$", parsing_timeout=None)), PrintedDecimal.read(gold)


class MathVerifyReward(SampleReward):
    """Binary reward: math-verify equivalence of the answer after ``</think>`` with ``Example.answer``.

    ``grade_math`` grades the last ``\\boxed{}`` after the think block, or every box there, joined, when the
    gold lists several parts (``2, 3``); both sides are read alike first (``tasks.mathnotation``: e-notation,
    ``\\times10^{n}``, ``\\mathbb Z``), and a gold printed as a rounded decimal (0.866) is compared at its
    printed precision, never looser.

    ``require_think``: True scores a completion without ``</think>`` 0 ("unclosed_think"): a thinking model
    cut off mid-thought has given no answer, whatever its draft boxed. None (the default) lets the chat
    template decide when the policy calls ``adapt_to_tokenizer``: True if the template opens ``<think>`` in
    the prompt (DeepSeek-R1-Distill), where a cut-off completion carries neither tag and nothing else tells
    it from an answer. Until then, or for a reward used on its own, None grades as False, which suits models
    that write no think tags (and a completion that opens ``<think>`` itself and never closes it has no
    answer either way).

    ``require_box``: True (the default) scores an answer without a box after ``</think>`` 0 ("no_box");
    False grades the text after ``</think>`` instead, as DeepMath's authors do ("Hence the answer is 4.").
    The box is the default because the prompt asks for one and it states the answer unambiguously, while
    math-verify reads free text by its last number ("3 steps, so 2 moves suffice" is graded as 2).

    Graded in ``workers`` processes with an outer ``timeout`` per answer (wall time); math-verify's grading of
    one answer has a deadline of ``timeout / 4`` seconds of CPU time (``DEADLINE_FRACTION``; also in-process,
    on the main thread), so that a loaded machine does not score a correct answer 0. A timeout, an
    exception or a gold answer that does not parse scores 0 and counts as a failure (labelled "timeout"
    or "error"; a hung pool is restarted). ``RewardResult.counts`` also holds "correct", "wrong" and the
    zero-scored labels "unclosed_think", "no_box", "unparsed", "too_long", "junk", "too_complex" (see
    ``grade_math``). DeepMath's authors use ``scale="pm1"``; {0, 1} is the canonical scale here.

    ``final_text``: grade the SoftmaxGRPO paper's final text (``tasks.similarity.final_text``: after the last
    ``</think>``, else the whole completion; then the last ``<answer>`` block's content). The paper's math
    verifier is ``MathVerifyReward(final_text=True, require_box=False, require_think=False)``: the final text
    graded by math-verify, boxed or not.
    """

    name = "math_verify"

    def __init__(
        self,
        require_box: bool = True,
        require_think: bool | None = None,
        scale: Scale = "01",
        name: str | None = None,
        workers: int = 2,
        timeout: float = 10.0,
        max_answer_chars: int = MAX_ANSWER_CHARS,
        final_text: bool = False,
    ) -> None:
        super().__init__(scale=scale, name=name, workers=workers, timeout=timeout)
        require(max_answer_chars >= 1, f"max_answer_chars must be >= 1, got {max_answer_chars}")
        self.require_box, self.final_text = require_box, final_text
        self.require_think = require_think
        self.max_answer_chars = max_answer_chars

    def adapt_to_tokenizer(self, tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        """With ``require_think=None``: require ``</think>`` if the chat template, rendered with the task's
        ``chat_template_kwargs``, opens ``<think>``."""
        if self.require_think is None:
            self.require_think = template_opens_think(tokenizer, chat_template_kwargs)

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        # CPU time, a quarter of the outer wall limit: a starved worker still ends at its own deadline
        timeout, think = self.timeout * DEADLINE_FRACTION, bool(self.require_think)
        return grade_math(
            example.answer, completion, self.require_box, timeout, self.max_answer_chars, think, self.final_text
        )


def grade_paper_math(gold: str, response: str, timeout: float | None = 5.0) -> tuple[float, str]:
    """The SoftmaxGRPO authors' math grading: 1.0 if math-verify finds the WHOLE ``final_text`` of ``response``
    (read with LaTeX and plain-expression extraction) equal to ``parse("\\boxed{" + gold + "}")`` (LaTeX
    extraction), with the gold first; else 0.0.

    Nothing else: no box required or preferred, every box of the text read together (``\\boxed{2} ... \\boxed{3}``
    reads as the set {2, 3}, which is not gold 3), no cheap string check, no respelling (e-notation, ``\\fbox``,
    ``\\mathbb``), no tolerance for a gold printed as a rounded decimal, no guard against huge answers beyond the
    deadline. Labels: "correct", "wrong", "unparsed" (nothing extracted from the answer), "gold_unparsed" (the gold
    itself extracts nothing: 0, as the authors score it). ``TimeoutError`` if grading spends over ``timeout`` seconds of
    CPU time (math-verify's own default limits are 5 s of wall time for parsing and 5 s for verifying; enforced on
    the main thread).
    """
    try:
        with _deadline(timeout):
            expected = parse(f"\\boxed{{{gold}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
            if not expected:
                return 0.0, "gold_unparsed"
            configs = [LatexExtractionConfig(), ExprExtractionConfig()]
            actual = parse(final_text(response), extraction_config=configs, parsing_timeout=None)
            if not actual:
                return 0.0, "unparsed"
            return (1.0, "correct") if verify(expected, actual, timeout_seconds=None) else (0.0, "wrong")
    except _Deadline:
        raise TimeoutError(f"math-verify grading took over {timeout:g} s of CPU time") from None


class PaperMathVerify(MathVerifyReward):
    """The math reward in the SoftmaxGRPO authors' grading (``grade_paper_math``): the paper's configs use it.
    ``MathVerifyReward`` is sgrpo's own grading (a box after ``</think>``, several parts read together only for a
    gold of several parts, respelling, rounded-decimal tolerance, guards), which sgrpo's own configs use.

    A ``MathVerifyReward``, so a task that takes success from its math reward (``DeepMath``, ``Polaris``) does so
    here too. Graded in ``workers`` processes with an outer ``timeout`` per answer (wall time; math-verify's grading
    has a deadline of ``timeout / 4`` seconds of CPU time, ``DEADLINE_FRACTION``); a timeout or an error scores 0
    and counts as a failure.
    """

    name = "math_verify"

    def __init__(self, scale: Scale = "01", name: str | None = None, workers: int = 2, timeout: float = 10.0) -> None:
        super().__init__(require_box=False, require_think=False, scale=scale, name=name, workers=workers,
                         timeout=timeout, final_text=True)  # fmt: skip

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        return grade_paper_math(example.answer, completion, self.timeout * DEADLINE_FRACTION)


def numeric_answer(text: str) -> float | None:
    """The number a response gives: its last ``\\boxed{}`` read as one number (``box_number``), else the text's last
    number; None for a box that holds no single number or was cut off (the last number of a cut box's start was read
    as the answer, and ``\\boxed{\\frac{1}{2}}`` or ``\\boxed{2^{10}}`` as 2 or 10)."""
    text = strip_think(text).replace(MINUS_SIGN, "-")
    if _BOX.search(text):
        box = last_boxed(text)
        return None if box is None else box_number(box)
    plain = _COMMAND.sub(r"\g<0> ", _DIGIT_COMMA.sub("", text).replace(",", " ").replace("$", ""))
    numbers = _NUMBER.findall(plain)
    return float(numbers[-1]) if numbers else None


def box_number(box: str) -> float | None:
    """A box's content as one number: a signed decimal (``.25``, ``-.5``, ``+18``, ``1,000``, ``1{,}000``,
    ``25\\%``), with what holds no number around it (``\\text{...}``, ``\\mathbf{...}`` and such wrappers, spacing,
    ``^\\circ``, a unit's ``^2``, outer braces, words after it, ``Total = `` before it), or a fraction
    (``\\frac{1}{2}``, ``3/4``); else None: an expression (``5\\pi``, ``18!``, ``20/x``, ``50 - x``, ``{18}^2``,
    ``x != 18``), several numbers."""
    plain = box.replace(MINUS_SIGN, "-")
    while (unwrapped := _WRAPPER.sub(r" \1 ", plain)) != plain:
        plain = unwrapped
    plain = _DIGIT_GROUP.sub("", _UNIT_POWER.sub(r"\1", _DEGREES.sub("", plain)))
    for mark, by in (("\\!", ""), (",", " "), ("$", " "), ("\\%", " "), ("%", " ")):
        plain = plain.replace(mark, by)
    plain = _LAYOUT.sub(" ", plain).strip()
    while plain.startswith("{") and plain.endswith("}") and _box_end(plain, 0) == len(plain) - 1:
        plain = plain[1:-1].strip()
    if number := _BOX_NUMBER.fullmatch(plain):
        return float(number.group(1).replace(" ", ""))
    if fraction := _FRACTION.fullmatch(plain):
        sign, top, bottom = (fraction.group(1), fraction.group(2), fraction.group(3))
        if top is None:
            sign, top, bottom = "", fraction.group(4), fraction.group(5)
        return None if float(bottom) == 0 else float(f"{sign}{top}") / float(bottom)
    return None


class NumericMatch(SampleReward):
    """Binary reward without sympy: the response's number (``numeric_answer``) equals the gold number.

    Equal means ``|x - gold| <= 1e-6 * max(1, |gold|)``. Commas and ``$`` are ignored.
    """

    name = "numeric_match"

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        value = numeric_answer(completion)
        if value is None:
            return 0.0, "no_number"
        gold = float(example.answer.replace(",", ""))
        return (1.0, "correct") if abs(value - gold) <= 1e-6 * max(1.0, abs(gold)) else (0.0, "wrong")


def final_text_verifier(**settings) -> MathVerifyReward:
    """The SoftmaxGRPO paper's math verifier: math-verify of the ``final_text``, boxed or not, without ``</think>``
    required (``settings``: ``MathVerifyReward``'s others, such as ``name``, ``workers``, ``timeout``)."""
    return MathVerifyReward(final_text=True, require_box=False, require_think=False, **settings)
