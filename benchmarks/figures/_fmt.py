"""Number and table formatting shared by the figure renders (``benchmarks/figures``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence


def num(x: float, digits: int = 1) -> str:
    """``x`` to ``digits`` decimals with thousands commas (``1,286``); never ``-0``."""
    text = f"{x:,.{digits}f}"
    return text[1:] if text.startswith("-") and float(text.replace(",", "")) == 0 else text


def signed(x: float, digits: int = 1) -> str:
    """``x`` with an explicit sign: ``+1.27``, ``-0.43``."""
    text = num(x, digits)
    return text if text.startswith("-") else "+" + text


def pct(x: float, digits: int = 1) -> str:
    """A fraction as a percentage: ``0.058 -> '5.8 %'``."""
    return f"{num(100 * x, digits)} %"


def pct_ci(pair: Sequence[float], digits: int = 1) -> str:
    """``[mean, half]`` of a fraction: ``'5.8 % ± 0.8'``."""
    return f"{pct(pair[0], digits)} ± {num(100 * pair[1], digits)}"


def pts_ci(pair: Sequence[float], digits: int = 1, scale: float = 100) -> str:
    """A signed difference ± half-width in points: ``'+6.3 ± 3.0'``."""
    return f"{signed(scale * pair[0], digits)} ± {num(scale * pair[1], digits)}"


def interval(mean: float, half: float, digits: int = 2, scale: float = 100) -> str:
    """``'+1.27 [+0.36, +2.17]'``: a difference and its interval."""
    lo, hi = scale * (mean - half), scale * (mean + half)
    return f"{signed(scale * mean, digits)} [{signed(lo, digits)}, {signed(hi, digits)}]"


def pval(p: float) -> str:
    return f"{p:.3f}"


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str | None = None) -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` (``---``) or ``r`` (``---:``),
    default: the first left, the rest right."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(line) + " |" if line is not rule else "|" + "|".join(line) + "|"
                     for line in lines)  # fmt: skip


def words(items: Sequence[str], last: str = "and") -> str:
    """``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {last} " + items[-1]


def spread(values: Iterable[float], digits: int = 2, fmt=None) -> str:
    """``'lo to hi'`` of ``values``, each formatted by ``fmt`` (default ``num(x, digits)``)."""
    values = sorted(values)
    fmt = fmt or (lambda x: num(x, digits))
    return f"{fmt(values[0])} to {fmt(values[-1])}"


def wrap(text: str, width: int = 110) -> str:
    """Reflow each paragraph of ``text`` (blank-line separated; tables and ``|`` lines kept) to ``width``."""
    out = []
    for para in text.strip("\n").split("\n\n"):
        if para.startswith("|"):
            out.append(para)
            continue
        line, lines = "", []
        for word in re.findall(r"[^\s`]*`[^`]*`[^\s`]*|\S+ %\S*|\S+", para):  # an inline code span is one word
            if line and len(line) + 1 + len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def label(spec: str) -> str:
    """A head-to-head spec label as the docs write it: ``SoftmaxGRPO(temperature=0.5)`` -> ``SoftmaxGRPO tau 0.5``."""
    if spec.startswith("SoftmaxGRPO(temperature=None"):
        return "SoftmaxGRPO, ESS rule"
    spec = spec.replace("DrGRPO", "Dr.GRPO").replace("(variant=practical)", " (practical)")
    return spec.replace("(temperature=", " tau ").replace(".0)", ")").rstrip(")") if "temperature=" in spec else spec


def overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the intervals ``mean ± half`` of ``a`` and ``b`` overlap."""
    return abs(a[0] - b[0]) <= a[1] + b[1]
