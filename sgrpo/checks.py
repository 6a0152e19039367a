"""Argument checks shared by the policy, the tasks and the rewards."""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: the one way sgrpo's classes check the arguments a
    config gives them, so that a bad value fails at construction, before any model loads, naming the field."""
    if not condition:
        raise ValueError(message)
