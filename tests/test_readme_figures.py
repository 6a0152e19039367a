"""Every benchmark figure the README quotes is traced to a committed artefact (``benchmarks/artefact.py``).

A README block fenced by ``<!-- figures: benchmarks/reports/NAME -->`` ... ``<!-- /figures -->`` may only
contain numbers that occur in that artefact: as written in its ``report.md``, or as a value of its
``result.json`` ``result`` (not its machine stamp) rounded to the README's digits (a fraction may be quoted
as a percentage).
Numbers inside inline code (commands) are not figures and are skipped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"<!-- figures: (\S+) -->\n(.*?)<!-- /figures -->", re.S)
# a sign counts only after a space or an opening bracket ("levels 7-9" is 7 and 9, "[-1.7, +0.8]" is signed)
NUMBER = re.compile(r"(?:(?<=[\s(\[|])[-+\u2212])?(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def numbers(text: str) -> list[str]:
    """The numeric tokens of ``text``, normalised: no thousands commas, ASCII minus, no plus sign."""
    found = (m.group(0).replace(",", "").replace("\u2212", "-").lstrip("+") for m in NUMBER.finditer(text))
    return [t[1:] if t.startswith("-") and float(t) == 0 else t for t in found]


def json_values(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in json_values(item)]
    if isinstance(value, list):
        return [v for item in value for v in json_values(item)]
    if isinstance(value, str):
        return [float(t) for t in numbers(value)]
    return []


def traced(token: str, report_tokens: set[str], values: list[float]) -> bool:
    """Whether README number ``token`` is in the report as written, or is a result value rounded to its digits."""
    if token in report_tokens:
        return True
    decimals = len(token.split(".")[1]) if "." in token else 0
    target = float(token)
    half_unit = 0.5 * 10**-decimals + 1e-12
    return any(abs(v - target) <= half_unit or abs(100 * v - target) <= half_unit for v in values)


def untraced(block: str, artefact: Path) -> list[str]:
    """The numbers of a README block that its artefact does not contain."""
    # the header's date may be quoted; its commit hash ("9cbd67e" reads as 9), CPU count and load may not
    report = re.sub(r"^(Date: [\d-]+),.*$", r"\1", (artefact / "report.md").read_text(), count=1, flags=re.M)
    values = json_values(json.loads((artefact / "result.json").read_text())["result"])  # not the machine stamp
    report_tokens = set(numbers(report))
    prose = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)", " ", block, flags=re.S)  # code spans, comments, link targets
    return [t for t in numbers(prose) if not traced(t, report_tokens, values)]


BLOCKS = BLOCK.findall(README)


@pytest.mark.parametrize("path,block", BLOCKS, ids=[f"{p}#{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_readme_block_is_traced_to_its_artefact(path, block):
    artefact = REPO / path
    assert (artefact / "result.json").is_file() and (artefact / "report.md").is_file(), f"{path}: no artefact"
    stamp = json.loads((artefact / "result.json").read_text())
    assert {"benchmark", "command", "date", "commit", "result"} <= set(stamp), f"{path}: result.json lacks its stamp"
    assert stamp["command"] in (artefact / "report.md").read_text()
    missing = untraced(block, artefact)
    assert not missing, f"README figures not found in {path}: {missing}"


def test_an_untraced_figure_fails(tmp_path, monkeypatch):
    """The check can fail: a number absent from the artefact is reported, a rounded one is accepted."""
    from benchmarks.artefact import publish

    # the stamp's load average (here 7 and 9) is no source of figures: it once traced "levels 7-9" by chance
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 9.0, 9.0))

    folder = publish("demo", {"accuracy": 0.05834, "runs": 96}, "# Demo\n\n| x | 1.14 |", "python demo.py", tmp_path)
    assert untraced("accuracy 5.8 % over 96 runs, +1.14 points", folder) == []
    assert untraced("accuracy 5.9 %, 1.15 points", folder) == ["5.9", "1.15"]
    assert untraced("run `python demo.py --seeds 12` on levels 7-9", folder) == ["7", "9"]


def test_the_stamp_traces_no_figure(tmp_path, monkeypatch):
    """A commit hash that starts with a digit, the CPU count and the load average are not figures."""
    from benchmarks import artefact

    monkeypatch.setattr(artefact, "_commit", lambda: "9cbd67e")
    monkeypatch.setattr(artefact, "machine", lambda: {"cpus": 2, "load_average": [7.5, 7.0, 7.0]})
    folder = artefact.publish("demo", {"runs": 96}, "# Demo", "python demo.py", tmp_path)
    assert "commit 9cbd67e" in (folder / "report.md").read_text()
    assert untraced("96 runs on levels 7-9 with 2 CPUs at load 7.5", folder) == ["7", "9", "2", "7.5"]
