"""Every benchmark figure the docs quote is *rendered from* the exact field of its committed artefact.

A block fenced by ``<!-- figures: benchmarks/reports/NAME -->`` ... ``<!-- /figures -->`` in README.md or
docs/*.md must equal, byte for byte, ``benchmarks.figures.render(NAME)`` (``python -m benchmarks.figures
--write`` regenerates them). The mutation test shows the comparison catches every single-figure change: a
digit of any number, a swap of two cells of a table row, a Holm p replaced by its unadjusted p and back. The
figure sections ("Comparing estimators", "Performance": README sections, or the docs pages of those titles)
hold no number outside such blocks but in headings and the prose parameters of ``PARAMETERS``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import figures

REPO = Path(__file__).resolve().parents[1]
DOCS = {path: path.read_text() for path in figures.documents(REPO)}
BLOCKS = [(path, name, body) for path, text in DOCS.items() for name, body in figures.blocks(text)]
BLOCK = figures.BLOCK
# a sign counts only after a space or an opening bracket ("levels 7-9" is 7 and 9, "[-1.7, +0.8]" is signed)
NUMBER = re.compile(r"(?:(?<=[\s(\[|])[-+\u2212])?(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def numbers(text: str) -> list[str]:
    """The numeric tokens of ``text``, normalised: no thousands commas, ASCII minus, no plus sign."""
    found = (m.group(0).replace(",", "").replace("\u2212", "-").lstrip("+") for m in NUMBER.finditer(text))
    return [t[1:] if t.startswith("-") and float(t) == 0 else t for t in found]


def test_every_artefact_block_is_found():
    quoted = {name for _, name, _ in BLOCKS}
    assert quoted, "no fenced block of figures in README.md or docs/*.md"
    assert quoted <= set(figures.RENDERS), f"blocks without a render: {quoted - set(figures.RENDERS)}"


@pytest.mark.parametrize("path,name,body", BLOCKS, ids=[f"{p.name}:{n}" for p, n, _ in BLOCKS])
def test_block_equals_its_render(path, name, body):
    rendered = figures.render(name)
    assert body == rendered, (
        f"{path.name}: the {name} block differs from its render (python -m benchmarks.figures --write)"
    )
    stamp = json.loads((figures.REPORTS / name / "result.json").read_text())
    assert {"benchmark", "command", "date", "commit", "result"} <= set(stamp), f"{name}: result.json lacks its stamp"
    if any(body in text for text in sections().values()):  # a figure section's block shows its command
        assert f"`{stamp['command']}`" in body, f"{name}: the block does not show `{stamp['command']}`"


def test_figures_md_equals_its_render():
    for name in figures.RENDERS:
        assert (figures.REPORTS / name / "figures.md").read_text() == figures.render(name), name


def p_pairs(value) -> list[tuple[float, float]]:
    """(unadjusted p, Holm p) of every comparison in a result."""
    if isinstance(value, dict):
        pairs = [(value["p"], value.get("holm_p", value.get("p_holm")))] if "p" in value and (
            "holm_p" in value or "p_holm" in value) else []  # fmt: skip
        return pairs + [p for v in value.values() for p in p_pairs(v)]
    return [p for v in value for p in p_pairs(v)] if isinstance(value, list) else []


def mutations(body: str, result: dict):
    """Every single-figure mutation of a rendered block: (kind, mutated body)."""
    code = [m.span() for m in re.finditer(r"`[^`]*`", body)]
    for m in re.finditer(r"\d+(?:\.\d+)?", body):  # each number token, its last digit changed
        if any(a <= m.start() < b for a, b in code):
            continue  # the command (code) is checked above; its digits are not figures
        token = m.group(0)
        yield "digit", body[: m.end() - 1] + str((int(token[-1]) + 1) % 10) + body[m.end() :]
    lines = body.split("\n")
    for i, line in enumerate(lines):  # a swap of two cells of a table row
        if line.startswith("| ") and not set(line) <= set("|-: "):
            cells = line.strip("|").split("|")
            for a in range(len(cells)):
                for b in range(a + 1, len(cells)):
                    if cells[a].strip() != cells[b].strip():
                        swapped = cells.copy()
                        swapped[a], swapped[b] = cells[b], cells[a]
                        yield "swap", "\n".join([*lines[:i], "|" + "|".join(swapped) + "|", *lines[i + 1 :]])
    for p, holm in p_pairs(result):  # a p-value replaced by the other kind
        for old, new in ((f"{holm:.3f}", f"{p:.3f}"), (f"{p:.3f}", f"{holm:.3f}")):
            if old != new:
                for m in re.finditer(rf"(?<![\d.]){re.escape(old)}(?!\d)", body):
                    yield "p kind", body[: m.start()] + new + body[m.end() :]


def test_every_single_figure_mutation_is_caught(capsys):
    """Each mutation of each rendered block, put in a document, makes the document differ from its render."""
    tried: dict[str, int] = {}
    missed = []
    for name in figures.RENDERS:
        body = figures.render(name)
        result = json.loads((figures.REPORTS / name / "result.json").read_text())["result"]
        fence = f"<!-- figures: benchmarks/reports/{name} -->\n"
        assert figures.differences(f"# Doc\n\n{fence}{body}<!-- /figures -->\n") == ""
        for kind, mutated in mutations(body, result):
            tried[kind] = tried.get(kind, 0) + 1
            if not figures.differences(f"# Doc\n\n{fence}{mutated}<!-- /figures -->\n"):
                missed.append((name, kind))
    with capsys.disabled():
        print(f"\nmutations tried {sum(tried.values())} ({tried}), caught {sum(tried.values()) - len(missed)}")
    assert tried.get("digit", 0) > 500 and tried.get("swap", 0) > 500 and tried.get("p kind", 0) > 20, tried
    assert not missed, missed


def test_a_render_fails_loudly_when_its_claim_no_longer_holds():
    """A comparative sentence is computed and asserted: data that contradicts it fails the render."""
    stamp = json.loads((figures.REPORTS / "bandit" / "result.json").read_text())
    stamp["result"]["estimators"]["MaxRL"]["pass@1_by_p0"]["0.2"][0] = 0.99  # MaxRL now beats GRPO at p0 = 0.2
    with pytest.raises(AssertionError, match="GRPO is not best"):
        figures.renderer("bandit")(stamp)


def test_classification_lr_render_follows_the_grid():
    """A rate added below the grid, where Dr.GRPO and RLOO do best, changes the stated best rates and edges from the
    data, not by hand."""
    stamp = json.loads((figures.REPORTS / "classification_lr" / "result.json").read_text())
    r = stamp["result"]
    low = min(r["lrs"])
    new = low / 2
    r["by_lr"][str(new)] = json.loads(json.dumps(r["by_lr"][str(low)]))
    for k in ("RLOO", "Dr.GRPO"):
        r["by_lr"][str(new)]["estimators"][k]["top-1"]["mean"] = 9.0
        r["best"][k]["lr"] = new
    r["lrs"] = [new, *r["lrs"]]
    text = " ".join(figures.renderer("classification_lr")(stamp).split())
    assert f"base rates {new:g}, {low:g}," in text
    assert f"{new:g} for Dr.GRPO and RLOO (9.00 % top-1, the lowest rate" in text


#: the README sections (each with its ### subsections) whose figures all come from benchmarks
FIGURE_SECTIONS = ("Comparing estimators", "Performance")
#: numbers allowed outside a fenced block in those sections: phrases that state a setting of a benchmark or
#: of the engine, never a measured result (each with why)
PARAMETERS = {
    r"\bdocs/(?:theory|objective|gradient_budget|policy_loss|reference_numbers)\.md §\d+(?:\.\d+)?":
        "a section number of the theory notes",
    r"\bpass@\d+": "a metric's name",
    r"\b95 ?% (?:CIs?|confidence intervals?|t-intervals?)": "the confidence level of an interval",
    r"\btau \d+(?:\.\d+)?\b": "an estimator's temperature setting",
    r"\bResNet-50\b": "a model's name",
}


def sections(text: str | None = None, titles=FIGURE_SECTIONS) -> dict[str, str]:
    """The body of each figure section: the ``## title`` section of ``text`` (default: README.md), or, once
    moved, the docs page headed ``# title`` (the whole page)."""
    out = {}
    for title in titles:
        match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text or DOCS[REPO / "README.md"], re.S | re.M)
        if match:
            out[title] = match.group(1)
        elif text is None:
            pages = [t for p, t in DOCS.items() if p.parent.name == "docs" and re.match(rf"# {re.escape(title)}\n", t)]
            assert pages, f"neither README.md nor a docs page has the section '{title}'"
            out[title] = pages[0]
    assert out, f"no figure section in {titles}"
    return out


def unfenced_figures(text: str, titles=FIGURE_SECTIONS) -> list[tuple[str, str]]:
    """(section, number) for each number of the ``titles`` sections outside a fenced block, inline code,
    comment, link target, heading or ``PARAMETERS`` phrase."""
    found = []
    for title, body in sections(text, titles).items():
        body = BLOCK.sub(" ", body)
        body = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)|^#+ [^\n]*", " ", body, flags=re.S | re.M)
        for phrase in PARAMETERS:
            body = re.sub(phrase, " ", body)
        found += [(title, number) for number in numbers(body)]
    return found


def test_figure_sections_have_no_figure_outside_a_fenced_block():
    stray = unfenced_figures(None)
    assert not stray, f"numbers outside a <!-- figures: ... --> block (fence them or state a parameter): {stray}"


def test_an_unfenced_figure_is_found():
    """The section check can fail: a measured number outside a block is reported, one inside, in code, in a
    heading or in a stated parameter is not, and other sections are not checked."""
    text = (
        "## Comparing estimators\n\n### Head-to-head, sort 3..9\n\n"
        "Run `bench.py --seeds 12` (docs/reference_numbers.md §8.1).\n"
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
