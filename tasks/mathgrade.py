"""Math answer checking: the last ``\\boxed{}`` graded by math-verify, and a cheap numeric check.

``grade_math`` follows the DeepMath recipe (spec tasks.md §1.3): grade only the text after
``</think>``, compare the last box with the gold answer by math-verify with the gold FIRST (``verify``
is asymmetric). A cheap normalised string comparison runs first: it settles exact spellings without
sympy and is the only check for Yes/No answers (math-verify parses "Yes" as the product E*s*y).

Adversarial answers must not stall training, so before sympy sees a box, cheap checks reject what no
answer needs and what would make sympy run away: a box over ``max_answer_chars`` ("too_long"), control
characters or undecodable bytes ("junk"), brackets nested over ``MAX_NESTING`` or exponents over
``MAX_EXPONENT_DEPTH`` ("too_complex"), and, once parsed, a number over ``MAX_DIGITS`` digits such as
``9^{9^{9}}`` or a polynomial power of over ``MAX_EXPANSION_TERMS`` terms such as ``(1+x)^{1000}``
("too_complex"). What still runs away is cut by a deadline on the whole grading (``timeout``) and
raises ``TimeoutError``. math-verify's own timeouts (``signal.alarm``, whole seconds, per call) are
replaced by that deadline (``signal.setitimer``, main thread only), so ``MathVerifyReward`` grades in
worker processes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Iterator

from math_verify import parse, verify
from sympy import Basic, binomial, exp, factorial, factorial2, gamma

from sgrpo.types import Example
from tasks.base import SampleReward, Scale
from tasks.similarity import strip_think

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad|\\left|\\right|\s+|\$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = {"yes", "no"}
_JUNK = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")  # control characters, undecodable bytes

#: cheap limits on a box before sympy sees it (``reject_box``) and on what it parses to (``_log10_bound``)
MAX_ANSWER_CHARS = 1000
MAX_NESTING = 12  # braces, parentheses and brackets: each level of parentheses costs math-verify ~40 ms
MAX_EXPONENT_DEPTH = 3  # 2^{2^{2^{2}}} (3 nested exponents) passes, x^{x^{x^{x^{x}}}} does not
MAX_DIGITS = 100_000  # 2^{300000} passes; 9^{9^{9}} (370 million digits) does not
MAX_EXPANSION_TERMS = 200  # (1+x)^{199} passes; (1+x)^{1000} and (x+y+z)^{30} do not


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1 : i]
    return None  # unbalanced: the box was cut off


def normalize_answer(text: str) -> str:
    """A spelling-insensitive form: no spaces, ``$``, ``\\left``, ``\\text{}``; ``\\dfrac`` -> ``\\frac``."""
    text = _TEXT_WRAPPERS.sub(r"\1", text)
    text = _SPACING.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def grade_math(
    gold: str,
    response: str,
    require_box: bool = True,
    timeout: float | None = 5.0,
    max_answer_chars: int = MAX_ANSWER_CHARS,
) -> tuple[float, str]:
    """1.0 if ``response`` answers ``gold``, else 0.0, with a label for the outcome.

    Labels: "correct", "wrong", "no_box" (no ``\\boxed{}`` after the think block), "unparsed"
    (math-verify extracted nothing from the answer), and the cheap rejections "too_long", "junk",
    "too_complex" (module docstring; a box spelt exactly like the gold is never rejected).
    ``require_box=False`` grades the whole answer text when there is no box (then only the parsed-size
    check applies). Raises ``ValueError`` if the gold answer itself does not parse (a data problem) and
    ``TimeoutError`` if the grading outlives ``timeout`` seconds (fractions allowed; enforced on the main
    thread only, ``None`` disables it).
    """
    answer = strip_think(response)
    box = last_boxed(answer)
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
        raise TimeoutError(f"math-verify grading took over {timeout:g} s") from None


def reject_box(box: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The label of a box no answer needs and sympy may choke on ("too_long", "junk", "too_complex"), else None.

    Pure string checks, linear in the box's length: length, control characters or U+FFFD (bytes that did
    not decode), ``{ ( [`` nested over ``MAX_NESTING``, exponents nested over ``MAX_EXPONENT_DEPTH``.
    """
    if len(box) > max_chars:
        return "too_long"
    if _JUNK.search(box):
        return "junk"
    groups: list[bool] = []  # open groups: True for an exponent ``^{``
    exponents = 0  # exponent groups open
    previous = ""
    for char in box:
        if char in "{([":
            groups.append(char == "{" and previous == "^")
            exponents += groups[-1]
            if len(groups) > MAX_NESTING:
                return "too_complex"
        elif char in "})]" and groups:  # any closer closes the innermost group: intervals like [0, 1)
            exponents -= groups.pop()
        elif char == "^" and exponents >= MAX_EXPONENT_DEPTH:
            return "too_complex"
        if not char.isspace():
            previous = char
    return None


def _verify(gold: str, target: str) -> tuple[float, str]:
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} does not parse")
    predicted = parse(target, parsing_timeout=None)
    if not predicted:
        return 0.0, "unparsed"
    if any(isinstance(p, Basic) and _log10_bound(p) > MAX_DIGITS for p in predicted):
        return 0.0, "too_complex"
    correct = verify(list(gold_parsed), predicted, timeout_seconds=None)
    return (1.0, "correct") if correct else (0.0, "wrong")


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    # a group of G completions shares one gold answer: parse it once per process
    return tuple(parse(f"${gold}$", parsing_timeout=None))


_LOG10_2 = math.log10(2)


def _log10_bound(expr: Basic) -> float:
    """A cheap upper bound of the number of digits of ``expr`` (symbols count as 1), without evaluating it.

    ``inf`` for powers that expand a sum of symbols into over ``MAX_EXPANSION_TERMS`` terms.
    """
    if expr.is_Rational:
        return math.log10(max(abs(expr.p), abs(expr.q), 1))  # exact for Python ints of any size
    if expr.is_Float:
        _, mantissa, exponent, bits = expr._mpf_
        return abs(exponent + bits) * _LOG10_2 if mantissa else 0.0
    if expr.is_Pow:
        base, exponent = expr.args
        if base.free_symbols and base.is_Add and exponent.is_Integer and abs(exponent) > 1:
            terms = math.comb(abs(int(exponent)) + len(base.args) - 1, len(base.args) - 1)
            if terms > MAX_EXPANSION_TERMS:
                return math.inf
        return max(_log10_bound(base), _LOG10_2) * _magnitude(exponent)
    if isinstance(expr, exp):
        return _magnitude(expr.args[0]) * math.log10(math.e)
    if isinstance(expr, (factorial, factorial2, gamma, binomial)):  # n! <= n^n, C(n, k) <= n^k
        n = _magnitude(expr.args[0])
        k = _magnitude(expr.args[1]) if isinstance(expr, binomial) else n
        return min(n, k) * math.log10(max(n, 2.0))
    parts = [_log10_bound(arg) for arg in expr.args if isinstance(arg, Basic)]
    if not parts:
        return 0.0
    if expr.is_Mul:
        return sum(parts)
    return max(parts) + math.log10(len(parts))  # sums, functions, containers: about the largest part


def _magnitude(expr: Basic) -> float:
    """An upper bound of ``|expr|`` (``inf`` past 1e15)."""
    digits = _log10_bound(expr)
    return 10.0**digits if digits < 15 else math.inf


class _Deadline(BaseException):
    """Raised by SIGALRM inside math-verify or sympy when the grading time is up (caught by grade_math)."""


@contextlib.contextmanager
def _deadline(seconds: float | None, repeat: float = 0.05) -> Iterator[None]:
    """Raise ``_Deadline`` in this block after ``seconds`` (main thread only; elsewhere no limit).

    The alarm keeps firing every ``repeat`` seconds until the block exits: Python drops an exception
    raised while it runs a finaliser or a weakref callback ("Exception ignored in ..."), so a one-shot
    alarm that lands there would be lost and the grading would run unbounded.
    """
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.getsignal(signal.SIGALRM)
    if previous is None:  # a handler installed outside Python: restore the default
        previous = signal.SIG_DFL
    active = [True]

    def expire(signum, frame):
        if active[0]:
            raise _Deadline

    signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds, repeat)
    start = time.monotonic()
    try:
        yield
    finally:
        while active[0]:  # once this holds False the handler is inert; an alarm before that is retried
            try:
                active[0] = False
            except _Deadline:
                continue
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # someone else's timer was running: re-arm what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


class _DropTimeoutDisabled(logging.Filter):
    """math-verify warns that its timeouts are off; ``grade_math`` sets its own deadline instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabled())


class MathVerifyReward(SampleReward):
    """Binary reward: math-verify equivalence of the last ``\\boxed{}`` with ``Example.answer``.

    Graded in ``workers`` processes with an outer ``timeout`` per answer; math-verify's grading of one
    answer has a deadline of ``timeout / 2`` (also in-process, on the main thread). A timeout, an
    exception or a gold answer that does not parse scores 0 and counts as a failure (labelled "timeout"
    or "error"; a hung pool is restarted). ``RewardResult.counts`` also holds "correct", "wrong" and the
    zero-scored labels "no_box", "unparsed", "too_long", "junk", "too_complex" (see ``grade_math``).
    DeepMath's authors use ``scale="pm1"``; {0, 1} is the canonical scale here.
    """

    name = "math_verify"

    def __init__(
        self,
        require_box: bool = True,
        scale: Scale = "01",
        name: str | None = None,
        workers: int = 2,
        timeout: float = 10.0,
        max_answer_chars: int = MAX_ANSWER_CHARS,
    ) -> None:
        super().__init__(scale=scale, name=name, workers=workers, timeout=timeout)
        if max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {max_answer_chars}")
        self.require_box = require_box
        self.max_answer_chars = max_answer_chars

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        # half the outer limit: the deadline fires well before the pool gives up on the worker
        return grade_math(example.answer, completion, self.require_box, self.timeout / 2, self.max_answer_chars)


def numeric_answer(text: str) -> float | None:
    """The number a response gives: the last number in its last ``\\boxed{}``, else in the text."""
    text = strip_think(text)
    box = last_boxed(text)
    numbers = _NUMBER.findall((text if box is None else box).replace(",", "").replace("$", ""))
    return float(numbers[-1]) if numbers else None


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
