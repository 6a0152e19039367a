"""The Countdown verifier of the SoftmaxGRPO paper: an expression over the given numbers, parsed (never executed)
and evaluated in exact rational arithmetic.

Grammar (whitespace allowed between tokens)::

    expression := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := ("+" | "-") factor | INTEGER | "(" expression ")"
    INTEGER    := ASCII digits

Anything else (decimals, ``^``, ``**``, ``x``, implicit products such as ``2(3)``, names) does not parse.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from sgrpo.types import Example
from tasks.mathgrade import all_boxed
from tasks.reward import SampleReward
from tasks.similarity import final_text

#: the longest expression graded, in characters (after the box, ``$``, backticks and a final period are removed)
MAX_EXPRESSION_CHARS = 256
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")  # ASCII digits: "\d" would also read "٣" as 3
_RATIONAL = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:/\s*([0-9]+(?:\.[0-9]+)?)\s*)?")


class ExpressionError(ValueError):
    """The text is not an expression of the grammar, or divides by zero (``DivisionByZero``)."""


class DivisionByZero(ExpressionError):
    """A division whose divisor evaluates to 0."""


def _tokens(text: str) -> list[str | int]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            if text[position:].strip():
                raise ExpressionError(f"unexpected {text[position : position + 10]!r}")
            break
        tokens.append(int(match.group(1)) if match.group(1) else match.group(2))
        position = match.end()
    return tokens


class _Parser:
    """Recursive descent over the tokens; ``numbers`` collects every integer literal, in order."""

    def __init__(self, text: str) -> None:
        self.tokens, self.index, self.numbers = _tokens(text), 0, []

    def parse(self) -> Fraction:
        value = self.expression()
        if self.index != len(self.tokens):
            raise ExpressionError(f"unexpected {self.tokens[self.index]!r}")
        return value

    def peek(self) -> str | int | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            self.index += 1
            value = value + self.term() if self.tokens[self.index - 1] == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            self.index += 1
            operator, right = self.tokens[self.index - 1], self.factor()
            if operator == "/" and right == 0:
                raise DivisionByZero("division by zero")
            value = value * right if operator == "*" else value / right
        return value

    def factor(self) -> Fraction:
        token = self.peek()
        self.index += 1
        if token in ("+", "-"):
            value = self.factor()
            return -value if token == "-" else value
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            value = self.expression()
            if self.peek() != ")":
                raise ExpressionError("unclosed parenthesis")
            self.index += 1
            return value
        raise ExpressionError("expression ends early" if token is None else f"unexpected {token!r}")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``expression`` and its integer literals in order; ``ExpressionError`` if it does not
    parse or divides by zero. ``evaluate("(6 - 2) * 6 / 1")`` -> ``(Fraction(24), [6, 2, 6, 1])``."""
    parser = _Parser(expression)
    return parser.parse(), parser.numbers


def read_rational(text: str) -> Fraction | None:
    """``"24"``, ``"24.0"``, ``"48/2"``, ``"4.8 / 0.2"`` as an exact ``Fraction``; None for anything else or a zero
    denominator."""
    match = _RATIONAL.fullmatch(text)
    if match is None or (match.group(2) is not None and Fraction(match.group(2)) == 0):
        return None
    value = Fraction(match.group(1))
    return value if match.group(2) is None else value / Fraction(match.group(2))


def countdown_expression(completion: str) -> str:
    """The expression a completion gives: its ``final_text``, the content of the first ``\\boxed{}`` there if any,
    with every ``$`` and backtick removed, then a final period and surrounding whitespace."""
    text = final_text(completion)
    boxes = all_boxed(text)
    text = (boxes[0] if boxes else text).replace("$", "").replace("`", "").strip()
    return text[:-1].rstrip() if text.endswith(".") else text


def grade_countdown(completion: str, numbers: Sequence[int], target: int) -> tuple[float, str]:
    """1.0 if the completion's expression (``countdown_expression``) is at most ``MAX_EXPRESSION_CHARS`` long, has at
    most one ``=`` (its right side an exact rational equal to ``target``), uses each of ``numbers`` exactly once
    (as a multiset: a number given twice is used twice) and no other, and equals ``target`` exactly; else 0.0.

    Labels: "correct", "empty", "too_long", "equals" (several ``=``, or a right side that is not ``target``),
    "unparsed" (not the grammar), "division_by_zero", "numbers" (a number missing, reused or not given),
    "wrong" (the value is not ``target``).
    """
    expression = countdown_expression(completion)
    if not expression:
        return 0.0, "empty"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return 0.0, "too_long"
    if expression.count("=") > 1:
        return 0.0, "equals"
    if "=" in expression:
        expression, right = expression.split("=")
        if read_rational(right) != target:
            return 0.0, "equals"
    try:
        value, used = evaluate(expression)
    except DivisionByZero:
        return 0.0, "division_by_zero"
    except (ExpressionError, RecursionError):  # nesting deeper than the stack allows (not within 256 characters)
        return 0.0, "unparsed"
    if Counter(used) != Counter(int(n) for n in numbers):
        return 0.0, "numbers"
    return (1.0, "correct") if value == target else (0.0, "wrong")


class CountdownReward(SampleReward):
    """``grade_countdown`` of each completion against ``example.metadata["nums"]`` and the target
    ``int(example.answer)``, in {0, 1} (``scale`` "pm1": -1 / +1)."""

    name = "countdown"

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        return grade_countdown(completion, example.metadata["nums"], int(example.answer))
