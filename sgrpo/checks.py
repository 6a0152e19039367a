"""Argument checks shared by the policy, the tasks and the rewards, and the error a bad configuration raises."""

from __future__ import annotations

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: the one way sgrpo's classes check the arguments a
    config gives them, so that a bad value fails at construction, before any model loads, naming the field."""
    if not condition:
        raise ValueError(message)


def exit_with_error(message: str, status: int) -> NoReturn:
    """Print ``error: message`` and exit with ``status``: the one line a refused run leaves.

    The line goes to stderr in one write (print writes the text and its newline apart, and stderr passes each
    write straight through), so the lines of several processes refusing at once never run together.
    """
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(status)
