"""Every benchmark figure the docs quote is traced to a committed artefact (``benchmarks/artefact.py``).

A block of the README or of a docs/ page fenced by ``<!-- figures: benchmarks/reports/NAME -->`` ...
``<!-- /figures -->`` may only contain numbers that occur in that artefact: as written in its ``report.md``,
or as a value of its ``result.json`` ``result`` (not its machine stamp) rounded to the quoted digits (a
fraction may be quoted as a percentage); on a ``FIGURE_SECTIONS`` page it names the command that reproduces them (the
artefact's, in inline code). Numbers inside inline code (commands) are not figures and are skipped. And the
pages of benchmark figures (``FIGURE_SECTIONS``: docs/comparing.md, docs/performance.md) hold no number
outside such blocks, but in headings and in the prose parameters of ``PARAMETERS``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.docs_blocks import PAGES, REPO

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
    # the header's date, CPU count and load average may be quoted; its commit hash ("9cbd67e" reads as 9) may not
    report = re.sub(r"\bcommit [0-9a-f]+", "commit", (artefact / "report.md").read_text())
    values = json_values(json.loads((artefact / "result.json").read_text())["result"])  # not the machine stamp
    report_tokens = set(numbers(report))
    prose = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)", " ", block, flags=re.S)  # code spans, comments, link targets
    return [t for t in numbers(prose) if not traced(t, report_tokens, values)]


BLOCKS = [found for page in PAGES for found in BLOCK.findall(page.read_text())]  # README.md and docs/*.md


@pytest.mark.parametrize("path,block", BLOCKS, ids=[f"{p}#{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_readme_block_is_traced_to_its_artefact(path, block):
    artefact = REPO / path
    assert (artefact / "result.json").is_file() and (artefact / "report.md").is_file(), f"{path}: no artefact"
    stamp = json.loads((artefact / "result.json").read_text())
    assert {"benchmark", "command", "date", "commit", "result"} <= set(stamp), f"{path}: result.json lacks its stamp"
    assert stamp["command"] in (artefact / "report.md").read_text()
    if any(block in body for body in figure_pages().values()):  # a benchmark page's block shows its command
        assert f"`{stamp['command']}`" in block, f"{path}: the block does not show `{stamp['command']}`"
    missing = untraced(block, artefact)
    assert not missing, f"figures not found in {path}: {missing}"


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
    """A commit hash that starts with a digit traces no figure; the load the figures were measured at may be quoted."""
    from benchmarks import artefact

    monkeypatch.setattr(artefact, "_commit", lambda: "9cbd67e")
    monkeypatch.setattr(artefact, "machine", lambda: {"cpus": 2, "load_average": [7.5, 7.0, 7.0]})
    folder = artefact.publish("demo", {"runs": 96}, "# Demo", "python demo.py", tmp_path)
    assert "commit 9cbd67e" in (folder / "report.md").read_text()
    assert untraced("96 runs on levels 7-9 at load 7.5", folder) == ["7", "9"]


#: the pages whose figures all come from benchmarks, by title (each page is one ``# title`` section)
FIGURE_PAGES = {"Comparing estimators": REPO / "docs" / "comparing.md", "Performance": REPO / "docs" / "performance.md"}
FIGURE_SECTIONS = tuple(FIGURE_PAGES)
#: numbers allowed outside a fenced block in those sections: phrases that state a setting of a benchmark or
#: of the engine, never a measured result (each with why)
PARAMETERS = {
    r"\bdocs/theory\.md §\d+(?:\.\d+)?": "a section number of the theory notes",
    r"\bpass@\d+": "a metric's name",
    r"\b95 ?% (?:CIs?|confidence intervals?|t-intervals?)": "the confidence level of an interval",
    r"\btau \d+(?:\.\d+)?\b": "an estimator's temperature setting",
    r"\bResNet-50\b": "a model's name",
}


def sections(text: str, titles=FIGURE_SECTIONS) -> dict[str, str]:
    """The body of each ``## title`` section of ``text``, down to the next ``## `` heading."""
    out = {}
    for title in titles:
        match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        assert match, f"README has no section '## {title}'"
        out[title] = match.group(1)
    return out


def figure_pages() -> dict[str, str]:
    """The text of each ``FIGURE_PAGES`` page below its ``# title`` line."""
    out = {}
    for title, page in FIGURE_PAGES.items():
        heading, _, body = page.read_text().partition("\n")
        assert heading == f"# {title}", f"{page.name} does not open with '# {title}'"
        out[title] = body
    return out


def unfenced_figures(text: str, titles=FIGURE_SECTIONS) -> list[tuple[str, str]]:
    """(section, number) for each number of the ``titles`` sections outside a fenced block, inline code,
    comment, link target, heading or ``PARAMETERS`` phrase."""
    return stray_numbers(sections(text, titles))


def stray_numbers(bodies: dict[str, str]) -> list[tuple[str, str]]:
    found = []
    for title, body in bodies.items():
        body = BLOCK.sub(" ", body)
        body = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)|^#+ [^\n]*", " ", body, flags=re.S | re.M)
        for phrase in PARAMETERS:
            body = re.sub(phrase, " ", body)
        found += [(title, number) for number in numbers(body)]
    return found


def test_figure_pages_have_no_figure_outside_a_fenced_block():
    assert BLOCKS, "the docs have no fenced block of figures"
    stray = stray_numbers(figure_pages())
    assert not stray, f"numbers outside a <!-- figures: ... --> block (fence them or state a parameter): {stray}"


def test_an_unfenced_figure_is_found():
    """The section check can fail: a measured number outside a block is reported, one inside, in code, in a
    heading or in a stated parameter is not, and other sections are not checked."""
    text = (
        "## Comparing estimators\n\n### Head-to-head, sort 3..9\n\nRun `bench.py --seeds 12` (docs/theory.md §8.1).\n"
        "<!-- figures: benchmarks/reports/demo -->\n| GRPO | 5.8 % |\n<!-- /figures -->\n"
        "MaxRL gains 1.3 points.\n| tau 0.5 | 6.9 % |\n\n## Performance\n\nsgrpo is 0.61x TRL.\n\n"
        "## Development\n\n1,075 tests.\n"
    )
    assert unfenced_figures(text) == [("Comparing estimators", "1.3"), ("Comparing estimators", "6.9"),
                                      ("Performance", "0.61")]  # tau 0.5 is a setting (PARAMETERS)  # fmt: skip


def test_tests_publish_outside_the_committed_artefacts():
    """tests/conftest.py points benchmarks.artefact.REPORTS at a temporary folder: a test that runs a benchmark
    (test_head_to_head, test_head_to_head_tail, test_benchmarks_population) must not overwrite the committed ones."""
    from benchmarks import artefact

    assert artefact.REPORTS != REPO / "benchmarks" / "reports" and not artefact.REPORTS.is_relative_to(REPO)
    assert artefact.publish("demo", {}, "# Demo", "python demo.py").parent == artefact.REPORTS
