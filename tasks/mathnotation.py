"""Spellings of one math answer, read the same way before ``grade_math`` compares them.

- ``respell`` (what math-verify reads, and the start of ``normalize_answer``): ``\\mathbb Z`` ->
  ``\\mathbb{Z}`` (math-verify reads only the braced form as the integers); e-notation ``1.2e5`` and a
  decimal times a power of ten ``6.02\\times10^{23}`` -> an integer times a power of ten
  (``12\\cdot10^{4}``, ``602\\cdot10^{21}``): math-verify reads ``1.2e5`` as 1.2*e*5 (Euler's e) and
  ``6.02\\times10^{23}`` as a float, never equal to the integer it stands for.
- ``normalize_answer``: the string form of the cheap comparison: no spacing, ``$``, ``\\left``,
  ``\\text{}``; ``\\dfrac`` -> ``\\frac``; one-character scripts ``_{2}`` -> ``_2`` (``\\mathbb{Z}_{2}``,
  which math-verify leaves as text, then equals ``\\mathbb{Z}_2``).
- ``PrintedDecimal``: a gold printed with a decimal point, graded at its printed precision.
- ``several_parts``: a gold listing several answers (``2, 3``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sympy import Basic, Eq, Rational

_MATHBB = re.compile(r"\\mathbb\s*(?:\{\s*([A-Za-z])\s*\}|([A-Za-z]))")
_E_NOTATION = re.compile(r"(?<![\w.])(\d+)(?:\.(\d+))?[eE]([-+]?\d+)(?![\w.])")
_TIMES_TEN = re.compile(r"(?<![\w.])(\d+)\.(\d+)\s*(?:\\times|\\cdot|\*)\s*10\s*\^\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad|\\left|\\right|\s+|\$")
_SCRIPT = re.compile(r"([_^])\{([A-Za-z0-9])\}(?![A-Za-z0-9])")  # x_{2}y is x_2y; x_{2}3 is not x_23
_DECIMAL = re.compile(r"(-?)(\d*)\.(\d+)(?:(?:[eE]|\\times10\^|\\cdot10\^)\{?([-+]?\d{1,4})\}?)?")

#: a gold decimal with this many significant digits or more is taken as rounded (``PrintedDecimal``)
MIN_ROUNDED_DIGITS = 3


def _exact(integer: str, fraction: str, exponent: str) -> str:
    """``integer.fraction`` times ``10^exponent`` as an integer times a power of ten."""
    return f"{int(integer + fraction)}\\cdot10^{{{int(exponent) - len(fraction)}}}"


def respell(text: str) -> str:
    """``text`` with ``\\mathbb`` braced and e-notation or ``d.dd\\times10^{n}`` made exact (module docstring)."""
    text = _MATHBB.sub(lambda m: f"\\mathbb{{{m[1] or m[2]}}}", text)
    text = _E_NOTATION.sub(lambda m: _exact(m[1], m[2] or "", m[3]), text)
    return _TIMES_TEN.sub(lambda m: _exact(m[1], m[2], m[3] or m[4]), text)


def normalize_answer(text: str) -> str:
    """A spelling-insensitive form (module docstring): ``respell``, then spacing and wrappers removed."""
    text = _TEXT_WRAPPERS.sub(r"\1", respell(text))
    text = _SPACING.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return _SCRIPT.sub(r"\1\2", text).rstrip(".")


#: a comma between digits with three after it (and no fourth): a thousands separator, LaTeX's ``,\\!`` too
_THOUSANDS = re.compile(r"(?<=\d),(?:\\!)?(\d{3})(?!\d)")


def several_parts(gold: str) -> bool:
    """Does ``gold`` list several answers: a comma or semicolon outside brackets (set braces ``\\{ \\}`` aside)? A
    thousands separator (``1,000``, ``1,\\!000``, ``12,345,678``) is none: such a gold joined every box."""
    depth = 0
    for char in _THOUSANDS.sub(r"\1", gold).replace("\\{", "").replace("\\}", ""):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char in ",;" and depth == 0:
            return True
    return False


@dataclass(frozen=True)
class PrintedDecimal:
    """A number printed with a decimal point (``0.866``, ``6.02\\times10^{23}``, ``1.5e-3``).

    ``value`` is what it says exactly, ``place`` the power of ten its last printed digit is worth (0.866: -3),
    ``digits`` its significant digits (0.0500: 3). With ``MIN_ROUNDED_DIGITS`` digits or more it is taken as
    rounded, and an answer within half a unit of its last digit (``matches``) is right: 0.866 accepts
    ``\\frac{\\sqrt{3}}{2}`` and 0.86603, never 0.87 (the answer's coarser precision does not widen the
    window). A shorter one (0.5, 2.5) is usually exact, and its window (0.45 to 0.55) would accept wrong
    answers, so it is not.
    """

    value: Rational
    place: int
    digits: int

    @classmethod
    def read(cls, gold: str) -> PrintedDecimal | None:
        """The decimal ``gold`` spells (spacing and ``$`` ignored), or None for anything else."""
        match = _DECIMAL.fullmatch(_SPACING.sub("", gold))
        if match is None:
            return None
        sign, integer, fraction, exponent = match.groups()
        place = int(exponent or 0) - len(fraction)
        value = Rational(int(integer + fraction)) * Rational(10) ** place
        return cls(-value if sign else value, place, len((integer + fraction).lstrip("0")))

    @property
    def rounded(self) -> bool:
        return self.digits >= MIN_ROUNDED_DIGITS

    def matches(self, predicted: list) -> bool:
        """Is one of math-verify's parsed answers (a number, or ``x = number``) within half a unit of the last digit?"""
        half_unit = Rational(10) ** self.place / 2
        for answer in predicted:
            if isinstance(answer, Eq):
                answer = answer.rhs
            if not isinstance(answer, Basic) or not answer.is_number:
                continue
            value = answer.evalf(30)
            if value.is_real and bool(abs(value - self.value) <= half_unit):
                return True
        return False
