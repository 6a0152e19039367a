"""The parser's refusals in one line: ``error: invalid configuration: ...``, the nearest key suggested.

jsonargparse prints the whole usage (85 lines for ``sgrpo.fit``) before its error, and a value that fits no
type of a union as an eight-line dump with the constructor's message in the middle; ``one_line_errors``
makes a parser say only the error, and ``union_error`` keeps only the constructor's message.
"""

from __future__ import annotations

import difflib
import importlib
import re
import types
from typing import Any

from sgrpo.checks import exit_with_error

#: an option the parser did not know: ``unrecognized arguments: --model.grup_size=8`` (command line) or
#: ``Group 'model' does not accept option 'grup_size'`` (a config file)
_UNKNOWN = re.compile(r"unrecognized arguments: --([\w.]+)|Group '([\w.]+)' does not accept option '(\w+)'")
#: a class the parser could not import: ``module 'estimators' has no attribute 'GRPo'``
_NO_CLASS = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")


def union_error(message: str) -> str:
    """The parser's dump for a value that fits no type of a union (``rollout: RolloutEngine | None`` with
    ``temperature: 0``; ``max_grad_norm: float | None`` with ``abc``: eight lines) as ``key: error (given value)``:
    the keys it names joined into one path, each non-None subtype's error with its nested lines, the value."""
    if "Does not validate against any of the Union subtypes" not in message:
        return message
    lines = message.splitlines()
    keys = [m.group(1) for line in lines if (m := re.match(r'\s*Parser key "([^"]+)"', line))]
    errors, current, indent = [], None, 0
    for line in lines:
        text, depth = line.strip(), len(line) - len(line.lstrip())
        if text.startswith("- "):
            current, indent = [text[2:]], depth
            errors.append(current)
        elif current is not None and depth > indent:
            if not text.startswith("Parser key"):  # a nested key: in the path already
                current.append(text)
        else:
            current = None
    errors = [" ".join(e) for e in errors if not e[0].startswith("Expected a <class 'NoneType'>")]
    given = next((line.strip() for line in lines if line.strip().startswith("Given value:")), "")
    given = "" if not given or "NestedArg" in given else f" ({given})"
    return f"{'.'.join(keys)}: {'; '.join(errors) or message}{given}" if keys else "; ".join(errors) or message


def one_line(message: str, keys: list[str]) -> str:
    """``message`` on one line, the constructor's message of a union dump alone, an unknown key with the nearest
    of ``keys`` suggested."""
    message = union_error(message)
    if "Problem with given class_path" in message:  # the class path's own error, not the parser's other attempts
        key = message[: message.index("Problem with given class_path")].strip().rstrip(":")
        key = key.removeprefix("Parser key ").strip('"')
        message = (f"{key}: " if key else "") + message[message.index("Problem with given class_path") :]
    unknown, no_class = _UNKNOWN.search(message), _NO_CLASS.search(message)
    nearest = []
    if unknown:
        key = unknown.group(1) or f"{unknown.group(2)}.{unknown.group(3)}"
        nearest = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    elif no_class:
        module, name = no_class.groups()
        try:
            names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except ImportError:
            names = []
        nearest = [f"{module}.{n}" for n in difflib.get_close_matches(name, names, n=1, cutoff=0.6)]
    if nearest:
        message += f" (did you mean {nearest[0]}?)"
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def one_line_errors(parser: Any) -> Any:
    """Make ``parser`` exit 2 with ``error: invalid configuration: ...`` on one line, without the usage."""
    original = parser.error

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # the parser tries a type and catches its own error: keep its behaviour
            return original(message, ex)
        keys = [action.dest for action in self._actions]
        exit_with_error(f"invalid configuration: {one_line(message, keys)}", 2)

    parser.error = types.MethodType(error, parser)
    return parser
