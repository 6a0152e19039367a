"""End-of-run report: accuracy by difficulty (first -> last validation) and a PNG of the training curves."""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from estimators import BUCKETS
from sgrpo.eval.evaluation import result_sets
from sgrpo.eval.metrics_file import METRICS_FILE, Series, merge_records, read_metrics_file
from sgrpo.run.folders import logger_versions


def accuracy_table(history: list[dict[str, Any]]) -> str:
    """Markdown tables of accuracy per difficulty, the first validation against the last: one per evaluation set
    (titled by its name; ``sgrpo.eval.evaluation.result_sets``)."""
    if len(history) < 2:
        missing = "--validate_last true" if history and history[0]["step"] == 0 else "--validate_before true"
        return f"(need a validation before and after training for the table: set {missing})"
    first, last = history[0], history[-1]
    base = "(base)" if first["step"] == 0 else "(first validation)"  # without --validate_before: a trained step
    tables = []
    for name, before_set in result_sets(first).items():
        after_set = result_sets(last).get(name, {"by_difficulty": {}})
        lines = [name] if name else []
        lines += [
            f"| difficulty | step {first['step']} {base} | step {last['step']} (trained) | change |",
            "|---|---|---|---|",
        ]
        pairs = {}  # level -> (before, after), both measured (a level with no prompt there is nan or absent)
        levels = [*before_set["by_difficulty"], *(k for k in after_set["by_difficulty"] if k not in
                                                  before_set["by_difficulty"])]  # fmt: skip
        for level in levels:  # a level one validation lacks (other evaluation data on resume): "-" on its side
            before, after = (s["by_difficulty"].get(level, float("nan")) for s in (before_set, after_set))
            cells = [f"{v:.1%}" if v == v else "-" for v in (before, after)]
            change = f"{100 * (after - before):+.1f} pts" if before == before and after == after else "-"
            lines.append(f"| {level} | {cells[0]} | {cells[1]} | {change} |")
            if before == before and after == after:
                pairs[level] = (before, after)
        if pairs:  # the mean over the levels both validations measured (a missing one counted 0 before)
            mean_before, mean_after = (sum(p[i] for p in pairs.values()) / len(pairs) for i in (0, 1))
            change = 100 * (mean_after - mean_before)
            label = "mean over levels" if len(pairs) == len(levels) else "mean over levels in both"
            lines.append(f"| {label} | {mean_before:.1%} | {mean_after:.1%} | {change:+.1f} pts |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def read_metrics(path: Path) -> Series:
    """``metrics.csv`` of Lightning's CSVLogger as ``{key: [(step, value), ...]}``."""
    return merge_records(_csv_records(path))


def read_run_metrics(root: Path) -> Series:
    """The run's metrics: its ``metrics.jsonl`` (``sgrpo.eval.metrics_file``, kept whatever the logger).

    A run folder from before that file falls back to every ``lightning_logs/version_N/metrics.csv`` (one per
    start or resume), read in order: a step logged again by a later version takes the later value.
    """
    if (root / METRICS_FILE).exists():
        return read_metrics_file(root / METRICS_FILE)
    paths = logger_versions(root, "metrics.csv")
    return merge_records(record for path in paths for record in _csv_records(path))


def _csv_records(path: Path) -> Iterator[dict[str, float]]:
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            yield {key: float(value) for key, value in row.items() if key != "epoch" and value not in ("", None)}


#: ``val/accuracy``, ``val/accuracy/<level>``, and for each of several evaluation sets ``val/<set>/accuracy[/<level>]``
VAL_ACCURACY = re.compile(r"^val/(?:([^/]+)/)?accuracy(?:/(.+))?$")


def plot_curves(series: Series, path: Path, title: str = "") -> Path:
    """Reward and success rate, validation accuracy per difficulty, and L1 budget shares over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for key, label, style in (("train/reward", "reward (mean)", "-"), ("train/success_rate", "success rate", "--")):
        if key in series:
            steps, values = zip(*series[key])
            axes[0].plot(steps, _smooth(values), style, label=label)
    axes[0].set(title="training reward", xlabel="training step", ylabel="value (10-step moving mean)")
    for key in sorted(k for k in series if VAL_ACCURACY.match(k)):
        steps, values = zip(*series[key])
        evaluation_set, level = VAL_ACCURACY.match(key).groups()
        name = ("all levels" if level is None else f"difficulty {level}") if evaluation_set is None else (
            evaluation_set if level is None else f"{evaluation_set}: difficulty {level}")  # fmt: skip
        axes[1].plot(steps, values, marker="o", label=name, linewidth=2.5 if level is None else 1.2)
    axes[1].set(title="validation accuracy", xlabel="training step", ylabel="accuracy", ylim=(0, 1))
    for bucket in BUCKETS:
        key = f"train/budget/l1/{bucket}"
        if key in series and any(v > 0 for _, v in series[key]):
            steps, values = zip(*series[key])
            axes[2].plot(steps, _smooth(values), label=bucket.replace("_", "-"))
    axes[2].set(
        title="gradient budget (L1 share of |A|) by group success rate",
        xlabel="training step",
        ylabel="share (10-step moving mean)",
        ylim=(0, 1),
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_header(policy, root: Path) -> str:
    """What a report belongs to, in one line: the run folder, its steps, the estimator and its settings, the task,
    the model, the sampling temperature and LoRA (or full weights)."""
    peft = policy.peft
    weights = "full weights" if peft is None else f"LoRA rank {peft.rank}, alpha {peft.alpha:g}"
    return (
        f"run {root} ({policy.rollout_step} steps): {policy.estimator!r} on {type(policy.task).__name__}, model "
        f"{policy.model_path}, sampling temperature {policy.rollout.temperature:g}, {weights}"
    )


def write_report(policy, trainer) -> None:
    """Print the accuracy table and save ``report.md`` and ``curves.png`` in the run folder, each headed by the
    run it belongs to (``run_header``)."""
    root = Path(trainer.default_root_dir)
    header = run_header(policy, root)
    table = accuracy_table(policy.val_history)
    (root / "report.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{header}\nValidation accuracy by difficulty\n{table}")
    series = read_run_metrics(root)
    if series:
        png = plot_curves(series, root / "curves.png", title=header)
        print(f"curves: {png}")
    what = "trained adapter (PEFT)" if policy.peft is not None else "trained model"
    print(f"{what}: {policy.export_path}\nrun folder: {root}")



def _smooth(values, window: int = 10) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out
