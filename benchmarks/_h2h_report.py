"""The report of ``benchmarks/head_to_head.py`` (split from it; the runs stay there): the reference and headline
tables, pass@k and budget tables, ``report.md``, the run time and the figures."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks._common import markdown_table, use_agg_backend
from benchmarks._common import write_markdown as _write_markdown
from benchmarks._h2h_figures import plot_budget, plot_curves, plot_final, plot_pass
from benchmarks._h2h_stats import (
    BUDGET_BUCKETS,
    base_runs,
    budget_series,
    conclusion,
    fmt,
    mean_over_levels,
    paired,
    pass_ks,
    run_time_figures,
)

if TYPE_CHECKING:
    from benchmarks.head_to_head import EstimatorSpec

_ROOT = Path(__file__).resolve().parents[1]
COLORS = {"GRPO": "#d62728", "DrGRPO": "#ff7f0e", "RLOO": "#8c564b", "MaxRL": "#000000", "SoftmaxGRPO": "#2171b5"}
OTHER_COLORS = ("#2ca02c", "#9467bd", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


# ---------------------------------------------------------------------------------------------- statistics
def reference_table(results, specs) -> tuple[str, str]:
    """Seed-paired differences of every estimator against GRPO (or the first estimator when GRPO is absent)."""
    ref = next((s for s in specs if s.name == "GRPO" and not s.init_args and results[s.label]), None)
    ref = ref or next((s for s in specs if results[s.label]), None)
    if ref is None:
        return "", "no run finished"
    k = pass_ks(results)[-1]
    metrics = {
        "mean over levels": mean_over_levels,
        **{f"level {lv}": (lambda r, lv=lv: r["final"]["by_difficulty"][lv]) for lv in _levels(results)},
        f"pass@{k}": lambda r: r["final"]["pass_at_k"][k],
    }
    rows = []
    for spec in specs:
        if spec == ref or not results[spec.label]:
            continue
        cells = []
        for metric in metrics.values():
            mean, half, n = paired(results[spec.label], results[ref.label], metric)
            star = " \\*" if abs(mean) > half else ""  # False for a nan half-width (one seed)
            cells.append(
                "-" if n == 0 else f"{100 * mean:+.1f}" + ("" if math.isnan(half) else f" ± {100 * half:.1f}{star}")
            )
        rows.append([spec.label, *cells])
    note = (
        "\n\n\\* the 95 % CI excludes 0; among this many comparisons a few are expected by chance alone. "
        "pass@1 is not repeated: it is the overall accuracy, the mean over levels when levels are balanced."
    )
    return ref.label, markdown_table(["estimator", *(f"Δ {m}" for m in metrics)], rows) + note


# ---------------------------------------------------------------------------------------------- report
def line_styles(specs: list[EstimatorSpec]) -> dict[str, dict]:
    """Colour (fixed for the shipped estimators) and a distinct dash pattern per estimator, so curves
    that coincide stay visible."""
    styles, dashes = {}, ("-", "--", "-.", ":")
    for i, spec in enumerate(specs):
        first = next(s for s in specs if s.name == spec.name) == spec
        color = COLORS[spec.name] if first and spec.name in COLORS else OTHER_COLORS[i % len(OTHER_COLORS)]
        styles[spec.label] = {"color": color, "ls": dashes[i % len(dashes)], "label": spec.label}
    return styles


def headline_table(results, specs) -> tuple[str, list[str]]:
    levels = _levels(results)
    header = ["estimator", "mean over levels", "change from base", *(f"level {lv}" for lv in levels), "seeds"]
    base = base_runs(results)
    rows = [["base model (step 0)", fmt([r["initial"]["mean_over_levels"] for r in base]), "",
             *(fmt([r["initial"]["by_difficulty"][lv] for r in base]) for lv in levels), len(base)]]  # fmt: skip
    for spec in specs:
        runs = list(results[spec.label].values())
        if not runs:
            rows.append([spec.label, "(no finished run)", "", *("" for _ in levels), 0])
            continue
        change = [r["final"]["mean_over_levels"] - r["initial"]["mean_over_levels"] for r in runs]
        rows.append([spec.label, fmt([r["final"]["mean_over_levels"] for r in runs]),
                     fmt(change, sign=True).replace(" %", " pts"),
                     *(fmt([r["final"]["by_difficulty"][lv] for r in runs]) for lv in levels), len(runs)])  # fmt: skip
    return markdown_table(header, rows), levels


def pass_table(results, specs) -> str:
    ks = pass_ks(results)
    rows = [[s.label, *(fmt([r["final"]["pass_at_k"][k] for r in results[s.label].values()]) for k in ks)]
            for s in specs if results[s.label]]  # fmt: skip
    return markdown_table(["estimator", *(f"pass@{k}" for k in ks)], rows)


def budget_table(results, specs, out: Path) -> str:
    rows = []
    for spec in specs:
        seeds = list(results[spec.label])
        if not seeds:
            continue
        cells = []
        for bucket in BUDGET_BUCKETS:
            means = [sum(v for _, v in pts) / len(pts) for s in seeds
                     if (pts := budget_series(out / spec.slug / f"seed{s}", bucket))]  # fmt: skip
            cells.append(fmt(means))
        rows.append([spec.label, *cells])
    return markdown_table(["estimator", *(b.replace("_", "-") for b in BUDGET_BUCKETS)], rows)


def write_report(results, specs, args) -> Path:
    table, levels = headline_table(results, specs)
    ref_label, ref_table = reference_table(results, specs)
    walls = [r["wall_s"] for runs in results.values() for r in runs.values()]
    steps_done = sorted({r["steps"] for runs in results.values() for r in runs.values()})
    setup = (
        f"`{_rel(args.config)}` with only the estimator and the seed changed; {args.steps} training steps "
        f"(validation every {args.val_every} steps and before training), `val_samples={args.val_samples}`, "
        f"seeds {', '.join(map(str, args.seeds))}"
        + (f", extra arguments `{args.extra}`" if args.extra else "")
        + f". Runs finished: {len(walls)} of {len(specs) * len(args.seeds)}"
        + (f" (steps {steps_done})" if steps_done and steps_done != [args.steps] else "")
        + "."
    )
    sections = [
        "## Setup\n\n" + setup + " Cells are mean ± 95 % t-interval half-width over seeds (percent; "
        "\"pts\" = percentage points). Accuracy is the validation success rate averaged over "
        f"{args.val_samples} samples per prompt; the headline is its mean over difficulty levels.",
        "## Headline: final validation accuracy\n\n" + table,
        "## Conclusion\n\n" + conclusion(results, specs) + "\n\nDifferences are paired by seed: runs with the "
        "same seed share the initial model (the same for every seed), the training prompt order and the "
        "validation sampling seeds; every run is validated on the same prompts.",
        f"## Paired differences against {ref_label} (percentage points, mean ± 95 % CI over seeds)\n\n"
        + ref_table,
        "## pass@k at the end of training\n\n" + pass_table(results, specs),
        "## Gradient budget: L1 share of |A| by group success rate, mean over training\n\n"
        + budget_table(results, specs, args.out),
        "## Run time\n\n" + run_time(results, args),
        "## Figures\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plot_all(results, specs, levels, args)),
    ]  # fmt: skip
    return _write_markdown(args.out / "report.md", "Head-to-head: estimators on the quickstart task", sections)


def run_time(results, args) -> str:
    runs = [r for per_seed in results.values() for r in per_seed.values()]
    if not runs:
        return "No run finished."
    rt = run_time_figures(results)
    layouts = sorted({f"{r.get('jobs', '?')} at a time, {r['threads']} torch thread(s) each" for r in runs})
    text = (
        f"{rt['runs']} runs, {rt['minutes']:.1f} min of run time in all (mean {rt['minutes_per_run']:.1f} "
        f"min per run; {'; '.join(layouts)})."
    )
    if not args.report_only:
        text += f" This invocation took {(time.perf_counter() - args.started) / 60:.1f} min of wall clock"
        text += " (finished runs it skipped cost nothing)."
    return text  # fmt: skip


def plot_all(results, specs, levels, args) -> list[Path]:
    if not any(results.values()):
        return []
    use_agg_backend()
    shown = [s for s in specs if results[s.label]]
    colors = line_styles(specs)
    return [
        plot_final(results, shown, colors, levels, args.out / "accuracy_by_difficulty.png"),
        plot_curves(results, shown, colors, levels, args.out / "accuracy_curves.png"),
        plot_pass(results, shown, colors, args.out / "pass_at_k.png"),
        plot_budget(results, shown, colors, args.out, args.out / "budget_shares.png"),
    ]


def _levels(results) -> list[str]:
    first = next(r for runs in results.values() for r in runs.values())
    return list(first["final"]["by_difficulty"])


def _level_key(level: str) -> tuple[int, float | str]:
    try:
        return (0, float(level))
    except ValueError:
        return (1, level)


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(_ROOT)) if path.is_relative_to(_ROOT) else str(path)
