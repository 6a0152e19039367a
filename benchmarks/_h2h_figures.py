"""The figures of benchmarks/head_to_head.py's report (matplotlib, Agg backend set by the caller)."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks._common import save_figure
from benchmarks._h2h_stats import accuracy, base_runs, budget_series, ci, pass_ks, smooth


def plot_final(results, shown, colors, levels, path: Path) -> Path:
    import matplotlib.pyplot as plt

    groups = [*levels, "mean"]
    fig, ax = plt.subplots(figsize=(max(7, 1.9 * len(groups) + 0.4 * len(shown)), 4.6))
    width = 0.8 / len(shown)
    base = base_runs(results)
    for j, key in enumerate(groups):
        value = sum(accuracy(r["initial"], key) for r in base) / len(base)
        ax.hlines(
            value, j - 0.42, j + 0.42, colors="grey", linestyles=":", lw=2, label="base model" if j == 0 else None
        )
    for i, spec in enumerate(shown):
        runs = list(results[spec.label].values())
        stats = [ci([accuracy(r["final"], key) for r in runs]) for key in groups]
        x = [j - 0.4 + width * (i + 0.5) for j in range(len(groups))]
        err = [0 if math.isnan(h) else h for _, h in stats]
        bar = {"color": colors[spec.label]["color"], "label": spec.label, "ecolor": "0.55", "capsize": 3}
        ax.bar(x, [m for m, _ in stats], width * 0.92, yerr=err, **bar)  # grey error bars: visible on black
    ax.set_xticks(range(len(groups)), [f"level {g}" if g != "mean" else "mean over levels" for g in groups])
    ax.set(ylabel="final validation accuracy", ylim=(0, 1), title="Final accuracy by difficulty (95 % CI over seeds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(len(shown) + 1, 3))
    return save_figure(fig, path)


def plot_curves(results, shown, colors, levels, path: Path) -> Path:
    import matplotlib.pyplot as plt

    keys = ["mean", *levels]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4), sharex=True)
    for ax, key in zip(axes, keys):
        for spec in shown:
            runs = list(results[spec.label].values())
            steps = [e["step"] for e in runs[0]["history"]]
            stats = [ci([accuracy(r["history"][t], key) for r in runs]) for t in range(len(steps))]
            mean = [m for m, _ in stats]
            ax.plot(steps, mean, marker="o", ms=3, **colors[spec.label])
            if not any(math.isnan(h) for _, h in stats):
                lo, hi = [m - h for m, h in stats], [m + h for m, h in stats]
                ax.fill_between(steps, lo, hi, color=colors[spec.label]["color"], alpha=0.1)
        title = "mean over levels" if key == "mean" else f"level {key}"
        ax.set(title=title, xlabel="training step", ylabel="validation accuracy")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(shown), fontsize=9, bbox_to_anchor=(0.5, -0.06))
    fig.suptitle("Validation accuracy over training (bands: 95 % CI over seeds)")
    fig.tight_layout()
    return save_figure(fig, path)


def plot_pass(results, shown, colors, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ks = pass_ks(results)
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    base = base_runs(results)
    ax.plot([int(k) for k in ks], [sum(r["initial"]["pass_at_k"][k] for r in base) / len(base) for k in ks],
            ":", color="grey", lw=2, label="base model")  # fmt: skip
    for i, spec in enumerate(shown):
        runs = list(results[spec.label].values())
        stats = [ci([r["final"]["pass_at_k"][k] for r in runs]) for k in ks]
        x = [int(k) + 0.04 * (i - len(shown) / 2) for k in ks]
        err = [0 if math.isnan(h) else h for _, h in stats]
        ax.errorbar(x, [m for m, _ in stats], yerr=err, marker="o", capsize=3, **colors[spec.label])
    ax.set_xticks([int(k) for k in ks])
    ax.set(xlabel="k (samples per prompt)", ylabel="pass@k (all levels)", title="pass@k after training (95 % CI)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_budget(results, shown, colors, out: Path, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, bucket in zip(axes, ("near_solved", "hard")):
        for spec in shown:
            curves = [smooth(budget_series(out / spec.slug / f"seed{s}", bucket), 20) for s in results[spec.label]]
            curves = [c for c in curves if c]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = [p[0] for p in curves[0][:n]]
            stats = [ci([c[t][1] for c in curves]) for t in range(n)]
            ax.plot(steps, [m for m, _ in stats], **colors[spec.label])
            if not any(math.isnan(h) for _, h in stats):
                lo, hi = [m - h for m, h in stats], [m + h for m, h in stats]
                ax.fill_between(steps, lo, hi, color=colors[spec.label]["color"], alpha=0.12)
        name = bucket.replace("_", "-")
        ax.set(title=f"{name} groups", xlabel="training step", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("L1 share of |A| (20-step moving mean)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Gradient budget over training: near-solved vs hard prompts (bands: 95 % CI over seeds)")
    fig.tight_layout()
    return save_figure(fig, path)
