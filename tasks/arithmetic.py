"""The Countdown verifier of the SoftmaxGRPO paper, by its authors' rules: an expression over the given numbers,
parsed by Python's parser (never executed) and evaluated in exact rational arithmetic.

The expression is the completion's ``final_text`` with ``×``, ``÷`` and the Unicode minus ``−`` read as ``*``,
``/`` and ``-``; the content of the first ``\\boxed{...}`` without braces inside, if there is one; surrounding
whitespace, then ``$`` and backticks at either end, then whitespace, then every trailing period removed.

What is accepted on the left of an ``=`` is what ``ast.parse(..., mode="eval")`` reads as a tree of these nodes
only: a literal of type ``int`` from 0 to 10**6 (so no unary sign, no ``007``, but ``00``, ``1_000`` and ``0x10``
are literals as Python spells them), and ``+``, ``-``, ``*``, ``/`` between two such trees (parentheses group).
Anything else (decimals, ``**``, ``^``, ``-3``, ``2(3)``, names, calls) scores 0.
"""

from __future__ import annotations

import ast
import warnings
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from sgrpo.types import Example
from tasks.reward import SampleReward
from tasks.similarity import final_text

#: the longest expression graded, in characters (after the box, ``$``, backticks and trailing periods are removed)
MAX_EXPRESSION_CHARS = 256
#: the largest integer literal accepted
MAX_LITERAL = 10**6
#: the operator spellings read as ASCII before parsing
_SPELLINGS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}  # fmt: skip


class ExpressionError(ValueError):
    """The text is not an expression of the accepted form."""


def _first_flat_box(text: str) -> str | None:
    """The content of the first ``\\boxed{...}`` whose content holds no brace, else None."""
    position = 0
    while (start := text.find("\\boxed{", position)) >= 0:
        content = start + len("\\boxed{")
        end = text.find("}", content)
        if end < 0:
            return None
        if "{" not in text[content:end]:
            return text[content:end]
        position = start + 1
    return None


def countdown_expression(completion: str) -> str:
    """The expression a completion gives (the module docstring's rule)."""
    text = final_text(completion).translate(_SPELLINGS)
    box = _first_flat_box(text)
    if box is not None:
        text = box
    return text.strip().strip("`$").strip().rstrip(".")


def _value(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= MAX_LITERAL:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _value(node.left, used)
        return _OPERATORS[type(node.op)](left, _value(node.right, used))  # Fraction / 0: ZeroDivisionError
    raise ExpressionError(f"{type(node).__name__} is not an integer literal or + - * /")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``expression`` and its integer literals in order (left to right); ``ExpressionError``
    (or ``SyntaxError``) if it is not of the accepted form, ``ZeroDivisionError`` if it divides by zero.
    ``evaluate("(6 - 2) * 6 / 1")`` -> ``(Fraction(24), [6, 2, 6, 1])``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "1(2)" warns before it is refused
        tree = ast.parse(expression.strip(), mode="eval")
    used: list[int] = []
    return _value(tree.body, used), used


def _equals_target(right: str, target: int) -> bool:
    try:
        return Fraction(right.strip()) == Fraction(int(target))
    except (ValueError, ZeroDivisionError):
        return False


def grade_countdown(completion: str, numbers: Sequence[int], target: int) -> tuple[float, str]:
    """1.0 if the completion's expression (``countdown_expression``) is at most ``MAX_EXPRESSION_CHARS`` long, has at
    most one ``=`` (its right side read as ``Fraction(right)`` equal to ``target``: "24", "24.0", "48/2", "2.4e1"),
    uses each of ``numbers`` exactly once (as a multiset: a number given twice is used twice) and no other, and
    equals ``target`` exactly; else 0.0.

    Labels: "correct", "empty", "too_long", "equals" (several ``=``, or a right side that is not ``target``),
    "unparsed" (not the accepted form), "division_by_zero", "numbers" (a number missing, reused or not given),
    "wrong" (the value is not ``target``).
    """
    expression = countdown_expression(completion)
    if not expression:
        return 0.0, "empty"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return 0.0, "too_long"
    parts = expression.split("=")
    if len(parts) > 2 or (len(parts) == 2 and not _equals_target(parts[1], target)):
        return 0.0, "equals"
    try:
        value, used = evaluate(parts[0])
    except ZeroDivisionError:
        return 0.0, "division_by_zero"
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # ExpressionError is a ValueError
        return 0.0, "unparsed"
    if Counter(used) != Counter(int(n) for n in numbers):
        return 0.0, "numbers"
    return (1.0, "correct") if value == int(target) else (0.0, "wrong")


class CountdownReward(SampleReward):
    """``grade_countdown`` of each completion against ``example.metadata["nums"]`` and the target
    ``int(example.answer)``, in {0, 1} (``scale`` "pm1": -1 / +1)."""

    name = "countdown"

    def score_one(self, example: Example, completion: str) -> tuple[float, str]:
        return grade_countdown(completion, example.metadata["nums"], int(example.answer))
