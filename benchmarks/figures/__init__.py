"""Every benchmark figure the docs quote, rendered from the exact field of its committed artefact.

A block in ``README.md`` or ``docs/*.md`` fenced by ``<!-- figures: benchmarks/reports/NAME -->`` ...
``<!-- /figures -->`` is the output of ``render(NAME)``: the render functions (``RENDERS``, one per
artefact, in this package's family modules) turn the artefact's ``result.json`` (its ``result`` and the
stamp's date, command and machine) into the block's markdown, tables and sentences alike, and assert every
comparative claim they make against the data. ``artefact.publish`` writes the render next to ``report.md``
as ``figures.md``, so a fresh run produces the block's text.

    .venv/bin/python -m benchmarks.figures --write   # rewrite every block (and figures.md) from its artefact
    .venv/bin/python -m benchmarks.figures --check   # exit 1 with a diff where a block differs
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "benchmarks" / "reports"
BLOCK = re.compile(r"(<!-- figures: benchmarks/reports/(\S+) -->\n)(.*?)(<!-- /figures -->)", re.S)
#: artefact name -> "module:function" (lazy, so importing this package costs nothing)
RENDERS = {
    "bandit": "bandit_cls:bandit",
    "classification": "bandit_cls:classification",
    "classification_lr": "bandit_cls:classification_lr",
    "head_to_head": "h2h:head_to_head",
    "head_to_head_tail": "h2h_tail:head_to_head_tail",
    "scalar_head_to_head": "h2h:scalar_head_to_head",
    "gpu_hours": "perf:gpu_hours",
    "rewards": "perf:rewards",
    "logprob_memory": "perf:logprob_memory",
    "throughput": "perf:throughput",
    "throughput_forced": "perf:throughput",
    "throughput_ablation": "perf:throughput_ablation",
    "throughput_mmap": "perf:throughput_mmap",
    "packing": "packing:packing",
    "async_rollouts": "asynchronous:async_rollouts",
    "tools_quickstart": "tools:tools_quickstart",
}


def documents(root: Path = ROOT) -> list[Path]:
    """The files whose fenced blocks are rendered: README.md and docs/*.md, wherever the blocks now live."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def renderer(name: str):
    module, function = RENDERS[name].split(":")
    return getattr(importlib.import_module(f"benchmarks.figures.{module}"), function)


def render(name: str, reports: Path = REPORTS) -> str:
    """The markdown of the block that quotes artefact ``name`` (ends with a newline)."""
    stamp = json.loads((reports / name / "result.json").read_text())
    return renderer(name)(stamp)


def rewrite(text: str, reports: Path = REPORTS) -> str:
    """``text`` with every fenced block replaced by its render (a block of an unknown artefact is an error)."""
    cache: dict[str, str] = {}

    def block(match: re.Match) -> str:
        name = match[2]
        if name not in RENDERS:
            raise KeyError(f"no render for the fenced block of benchmarks/reports/{name} (add it to RENDERS)")
        cache.setdefault(name, render(name, reports))
        return match[1] + cache[name] + match[4]

    return BLOCK.sub(block, text)


def blocks(text: str) -> list[tuple[str, str]]:
    """(artefact name, body) of each fenced block of ``text``."""
    return [(m[2], m[3]) for m in BLOCK.finditer(text)]


def differences(text: str, label: str = "text", reports: Path = REPORTS) -> str:
    """A unified diff of ``text`` against its rendered blocks; empty when every block equals its render."""
    new = rewrite(text, reports)
    if new == text:
        return ""
    return "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), label, f"{label} (rendered)"))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the blocks and figures.md in place")
    mode.add_argument("--check", action="store_true", help="exit 1 and print a diff if any block differs")
    args = parser.parse_args(argv)
    failed = False
    for path in documents():
        text = path.read_text()
        diff = differences(text, str(path.relative_to(ROOT)))
        if diff and args.write:
            path.write_text(rewrite(text))
            print(f"rewrote {path.relative_to(ROOT)}")
        elif diff:
            print(diff, end="")
            failed = True
    for name in RENDERS:
        target, body = REPORTS / name / "figures.md", render(name)
        if not target.exists() or target.read_text() != body:
            if args.write:
                target.write_text(body)
                print(f"rewrote {target.relative_to(ROOT)}")
            else:
                print(f"{target.relative_to(ROOT)} differs from its render (run --write)")
                failed = True
    return 1 if failed else 0
