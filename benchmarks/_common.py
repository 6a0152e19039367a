"""Shared pieces of the head-to-head benchmarks: the estimator roster, colours, tables and intervals.

Imported as ``benchmarks._common`` by ``population.py``, ``bandit.py`` and ``paired.py`` (each script
puts the repository root first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from estimators import GRPO, RLOO, AdvantageEstimator, DrGRPO, MaxRL, SoftmaxGRPO

#: the SoftmaxGRPO temperatures the paper sweeps (arXiv 2608.09271)
TEMPERATURES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)

#: the difficulty buckets of docs/gradient_budget.md §6 (``unsolved`` and ``solved`` carry no mass)
SHOWN_BUCKETS: tuple[str, ...] = ("hard", "mid_hard", "half", "mid_easy", "near_solved")


@dataclass(frozen=True)
class Entry:
    """One estimator of a comparison: a short label, the estimator, a plot colour and line style."""

    label: str
    estimator: AdvantageEstimator
    color: str
    style: str = "-"

    @property
    def line(self) -> dict:
        """matplotlib keywords of this estimator's curves; dashed ones on top, so an estimator that
        coincides with another (Dr.GRPO and RLOO up to a constant) stays visible."""
        return {"color": self.color, "label": self.label, "ls": self.style, "zorder": 3 if self.style != "-" else 2}


def softmax_color(tau: float) -> str:
    """Blues from dark (small tau, MaxRL-like) to light (large tau, Dr.GRPO-like)."""
    shades = {0.25: "#08306b", 0.5: "#2171b5", 1.0: "#4292c6", 2.0: "#6baed6", 4.0: "#9ecae1"}
    return shades.get(tau, "#2171b5")


def roster() -> list[Entry]:
    """The estimators every benchmark compares: GRPO (sample std), Dr.GRPO, RLOO, MaxRL (practical),
    and SoftmaxGRPO at each temperature of ``TEMPERATURES``."""
    return [
        Entry("GRPO", GRPO(), "#d62728"),
        Entry("Dr.GRPO", DrGRPO(), "#ff7f0e", "--"),
        Entry("RLOO", RLOO(), "#8c564b"),
        Entry("MaxRL", MaxRL(), "#000000"),
        *(Entry(f"Softmax tau={tau:g}", SoftmaxGRPO(temperature=tau), softmax_color(tau)) for tau in TEMPERATURES),
    ]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one of 'l'/'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(map(str, header)) + " |", rule]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def t_interval(samples: Tensor, dim: int = 0, level: float = 0.95) -> tuple[Tensor, Tensor]:
    """Mean and half-width of the Student-t confidence interval over ``dim`` (n - 1 degrees of freedom)."""
    from scipy.stats import t as student_t  # scipy comes with the dev extra

    n = samples.shape[dim]
    mean = samples.mean(dim)
    if n < 2:
        return mean, torch.full_like(mean, math.nan)
    quantile = float(student_t.ppf(0.5 + level / 2, n - 1))
    return mean, quantile * samples.std(dim) / math.sqrt(n)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def save_figure(fig, path: Path) -> Path:
    """Save a matplotlib figure as PNG (150 dpi, tight) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_markdown(path: Path, title: str, sections: Sequence[str]) -> Path:
    """Write ``# title`` and the sections (already markdown) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n" + "\n\n".join(sections) + "\n")
    return path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows the module docstring as written and every option's default."""


def use_agg_backend() -> None:
    """Headless plotting (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
