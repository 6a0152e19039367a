"""Spellings of one math answer, read the same way before ``grade_math`` compares them.

- ``normalize_answer``: the string form of the cheap comparison: no spacing, ``$``, ``\\left``,
  ``\\text{}``; ``\\dfrac`` -> ``\\frac``.
- ``several_parts``: a gold listing several answers (``2, 3``).
"""

from __future__ import annotations

import re

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad|\\left|\\right|\s+|\$")


def normalize_answer(text: str) -> str:
    """A spelling-insensitive form: no spaces, ``$``, ``\\left``, ``\\text{}``; ``\\dfrac`` -> ``\\frac``."""
    text = _TEXT_WRAPPERS.sub(r"\1", text)
    text = _SPACING.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def several_parts(gold: str) -> bool:
    """Does ``gold`` list several answers: a comma or semicolon outside brackets (set braces ``\\{ \\}`` aside)?"""
    depth = 0
    for char in gold.replace("\\{", "").replace("\\}", ""):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char in ",;" and depth == 0:
            return True
    return False
