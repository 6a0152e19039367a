"""Reading the README and the pages of docs/ for the tests that hold them to the code: their fenced code
blocks, the commands they show, their links and their headings' anchors (tests/test_readme.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: every page of the documentation: the README, then docs/*.md
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: the line that marks the next code block as one the tests cannot run on a CPU, with the reason
NO_TEST = re.compile(r"^<!-- no-test:(.*?)-->$")
FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, the line of its opening fence (1-based), its language and code, and
    the reason given by a ``<!-- no-test: reason -->`` line right before it (None without one)."""

    page: Path
    line: int
    lang: str
    code: str
    no_test: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path, lang: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` (those in ``lang`` only, if given)."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == opening.group(1)), len(lines))
        marker = NO_TEST.match(lines[i - 1].strip()) if i else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(page, i + 1, opening.group(2), code, marker.group(1).strip() if marker else None))
        i = end + 1
    return [b for b in found if lang is None or b.lang == lang]


def all_blocks(lang: str) -> list[Block]:
    return [block for page in PAGES for block in blocks(page, lang)]


def prose(page: Path) -> str:
    """``page`` without its fenced code blocks (a ``#`` line in a bash block is no heading)."""
    lines = page.read_text().split("\n")
    for block in blocks(page):  # blank the code, keep the line numbers
        lines[block.line : block.line + block.code.count("\n")] = [""] * block.code.count("\n")
    return "\n".join(lines)


def anchors(page: Path) -> set[str]:
    """The ``#anchor`` of each heading of ``page``, as GitHub makes them (repeats get ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", prose(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: Path) -> list[str]:
    """The targets of the markdown links of ``page`` outside code blocks and code spans."""
    return LINK.findall(re.sub(r"`[^`\n]*`", " ", prose(page)))


def commands(text: str) -> str:
    """``text`` with shell line continuations joined, so that a command reads as one line."""
    return re.sub(r"\\\n\s*", " ", text)


def fit_commands(text: str) -> set[str]:
    """The ``python -m sgrpo.fit --config ...`` commands of ``text`` (in code blocks or inline code), each
    ending at its closing backtick, a comment, or a line that is not its indented continuation, with
    whitespace normalised."""
    found = re.findall(r"python -m sgrpo\.fit (--config.*?)(?:`|#|\n(?! ))", commands(text), flags=re.S)
    return {" ".join(command.split()) for command in found}


def shell(page: Path) -> str:
    """What ``page`` shows to run: its bash blocks, then its inline code spans, one per line."""
    spans = re.findall(r"`([^`\n]+)`", prose(page))
    return "\n".join([block.code for block in blocks(page, "bash")] + spans)


#: ``python -m MODULE ARGS`` (any python: the venv's, the vLLM venv's, srun's), up to a comment, pipe or ``;``
PYTHON_MODULE = re.compile(r"(?:^|[\s;&(])(?:\S*/)?python3? -m ([\w.]+)([^\n#|;&]*)", flags=re.M)


def module_commands(text: str) -> list[tuple[str, list[str]]]:
    """The ``python -m MODULE ARGS`` commands of ``text``: each module and its arguments, a usage line's optional
    parts (``[--merged]``) given."""
    optional = re.compile(r"\[(-[^\[\]]*)\]")  # "[--merged]" in a usage line; a list value ("[1, 2]") stays
    return [(m.group(1), shlex.split(optional.sub(r"\1", m.group(2))))
            for m in PYTHON_MODULE.finditer(commands(text))]  # fmt: skip


def make_targets(text: str) -> list[str]:
    """The targets of the ``make [VAR=value ...] TARGET`` commands of ``text``."""
    return re.findall(r"(?:^|[\s;&(])make(?: [A-Z_]+=\S+)* ([a-z][\w-]*)", commands(text), flags=re.M)
