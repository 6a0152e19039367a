"""Statistics of head-to-head runs: intervals over seeds, paired differences, the conclusion; shared by
benchmarks/head_to_head.py's tables and its figures."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks._common import t_interval
from sgrpo.eval.report import read_metrics

BUDGET_BUCKETS = ("hard", "mid_hard", "half", "mid_easy", "near_solved")


def ci(values: list[float]) -> tuple[float, float]:
    """Mean and 95 % t half-width (nan for one value)."""
    mean, half = t_interval(torch.tensor(values, dtype=torch.float64))
    return float(mean), float(half)


def fmt(values: list[float], sign: bool = False) -> str:
    """``61.2 % ± 3.4``: percent, mean ± 95 % half-width (no interval for one value)."""
    if not values:
        return "-"
    mean, half = ci(values)
    return f"{100 * mean:{'+' if sign else ''}.1f} %" + ("" if math.isnan(half) else f" ± {100 * half:.1f}")


def base_runs(results) -> list[dict]:
    """One run per seed: runs of a seed share the initial model, validation prompts and sampling seeds."""
    by_seed: dict[int, dict] = {}
    for runs in results.values():
        for seed, result in runs.items():
            by_seed.setdefault(seed, result)
    return [by_seed[s] for s in sorted(by_seed)]


def accuracy(entry: dict, key: str) -> float:
    return entry["mean_over_levels"] if key == "mean" else entry["by_difficulty"][key]


def budget_series(run_dir: Path, bucket: str) -> list[tuple[int, float]]:
    path = run_dir / "lightning_logs" / "version_0" / "metrics.csv"
    return _metrics(path, path.stat().st_mtime_ns).get(f"train/budget/l1/{bucket}", [])


@functools.lru_cache(maxsize=1024)
def _metrics(path: Path, mtime_ns: int) -> dict:
    """A run's metrics, read once per file version: a report asks for each bucket of each run several times (its
    tables, the artefact's figures, the budget figure), 96 runs of the tail took minutes of CSV parsing."""
    return read_metrics(path)


def smooth(points: list[tuple[int, float]], window: int = 10) -> list[tuple[int, float]]:
    out = []
    for i, (step, _) in enumerate(points):
        chunk = [v for _, v in points[max(0, i - window + 1) : i + 1]]
        out.append((step, sum(chunk) / len(chunk)))
    return out


def pass_ks(results) -> list[str]:
    first = next(r for runs in results.values() for r in runs.values())
    return list(first["final"]["pass_at_k"])


def final_means(runs: dict[int, dict]) -> dict[int, float]:
    return {seed: r["final"]["mean_over_levels"] for seed, r in runs.items()}


def mean_over_levels(result: dict) -> float:
    return result["final"]["mean_over_levels"]


def paired(a: dict[int, dict], b: dict[int, dict], metric=mean_over_levels) -> tuple[float, float, int]:
    """Mean and 95 % t half-width of the seed-paired difference a - b of ``metric(result)`` (default: final
    mean accuracy over levels), over the seeds both finished."""
    diffs = [metric(a[s]) - metric(b[s]) for s in sorted(set(a) & set(b))]
    if not diffs:
        return math.nan, math.nan, 0
    mean, half = ci(diffs)
    return mean, half, len(diffs)


def compare(best: str, other: str, results: dict[str, dict[int, dict]], role: str) -> str:
    mean, half, n = paired(results[best], results[other])
    if n == 0:
        return f"- Against {role} {other}: no seed finished for both, no comparison."
    text = f"- Against {role} {other}: {100 * mean:+.1f} pts (paired over {n} seed{'s' * (n > 1)}"
    if math.isnan(half):
        return text + "; one seed, so no confidence interval: not a test)."
    lo, hi = 100 * (mean - half), 100 * (mean + half)
    verdict = (
        "the interval excludes 0: a significant difference at 95 %"
        if lo > 0 or hi < 0
        else "the interval includes 0: no significant difference"
    )
    return text + f", 95 % CI [{lo:+.1f}, {hi:+.1f}] pts): {verdict}."


def overlap(a: list[float], b: list[float]) -> bool | None:
    (ma, ha), (mb, hb) = ci(a), ci(b)
    if math.isnan(ha) or math.isnan(hb):
        return None
    return ma - ha <= mb + hb and mb - hb <= ma + ha


def conclusion(results: dict[str, dict[int, dict]], specs: Sequence) -> str:
    """The best estimator by final mean accuracy over levels, against the runner-up and against GRPO.

    ``specs``: the run's ``EstimatorSpec`` objects (``name``, ``init_args``, ``label``).
    """
    means = {lab: list(final_means(runs).values()) for lab, runs in results.items() if runs}
    if not means:
        return "No run finished: nothing to compare."
    ranked = sorted(means, key=lambda lab: -ci(means[lab])[0])
    best, n = ranked[0], len(means[ranked[0]])
    interval = f"mean ± 95 % CI half-width over {n} seeds" if n > 1 else "one seed, no CI"
    lines = [f"**Best: {best}**, final mean accuracy over levels {fmt(means[best])} ({interval})."]
    if len(ranked) > 1:
        runner = ranked[1]
        if ci(means[best])[0] == ci(means[runner])[0]:
            lines[0] += f" It is tied with {runner}: the ranking between them is arbitrary."
        lines.append(compare(best, runner, results, "the runner-up"))
        both = overlap(means[best], means[runner])
        if both is not None:
            lines.append(
                f"- The per-estimator 95 % CIs of {best} and {runner} " + ("overlap." if both else "do not overlap.")
            )
    grpo = next((s.label for s in specs if s.name == "GRPO" and not s.init_args and s.label in means), None)
    if grpo == best:
        lines.append("- GRPO, the baseline, is itself the best.")
    elif grpo is not None and grpo == ranked[1]:
        lines.append("- GRPO, the baseline, is the runner-up (comparison above).")
    elif grpo is not None:
        lines.append(compare(best, grpo, results, "the GRPO baseline"))
    spread = [ci(means[lab]) for lab in ranked]
    defined = len(ranked) > 1 and all(not math.isnan(h) for _, h in spread)
    if defined and max(m - h for m, h in spread) <= min(m + h for m, h in spread):
        lines.append("- All estimators' 95 % CIs overlap: at this budget the seeds do not separate them.")
    base = [r["initial"]["mean_over_levels"] for r in base_runs(results)]
    if len(base) > 1:
        low, high = 100 * min(base), 100 * max(base)
        lines.append(f"- Validation noise alone: the base model scores {low:.1f} to {high:.1f} % over the seeds "
                     "(same model, different validation sampling seeds).")  # fmt: skip
    return "\n".join(lines)


def paired_p(diffs: list[float]) -> float:
    """Two-sided p-value of the one-sample t-test of mean 0 on seed-paired differences:
    ``p = 2 t_sf(|mean| sqrt(n) / sd, n - 1)`` (nan below 2 values; 0 when every difference is the same
    nonzero value, 1 when all are 0)."""
    from scipy.stats import t as student_t

    n = len(diffs)
    if n < 2:
        return math.nan
    d = torch.tensor(diffs, dtype=torch.float64)
    mean, sd = float(d.mean()), float(d.std())
    if sd == 0:
        return 0.0 if mean != 0 else 1.0
    return float(2 * student_t.sf(abs(mean) * math.sqrt(n) / sd, n - 1))


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values for m comparisons: with the p-values sorted ascending,
    ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``; reject at level a where ``p~ <= a``. It controls
    the family-wise error as Bonferroni (``m p``) does and rejects at least as much. nan entries are left out
    of m and stay nan."""
    finite = sorted((p, k) for k, p in pvalues.items() if not math.isnan(p))
    m, running, out = len(finite), 0.0, {k: math.nan for k in pvalues}
    for j, (p, key) in enumerate(finite):
        running = max(running, min(1.0, (m - j) * p))
        out[key] = running
    return out


def seed_interval(values: list[float]) -> list[float]:
    """``[mean, 95 % half-width]`` as plain floats, for an artefact's ``result``."""
    return list(ci(values)) if values else [math.nan, math.nan]


def run_time_figures(results, wall_s: float | None = None) -> dict:
    """The run time a report states, as its figures: finished runs, their minutes in all and per run (1 decimal),
    how many ran at a time, and (when given) the invocation's wall clock in minutes."""
    runs = [r for per_seed in results.values() for r in per_seed.values()]
    walls = [r["wall_s"] for r in runs]
    figures = {"runs": len(walls), "minutes": round(sum(walls) / 60, 1),
               "minutes_per_run": round(sum(walls) / max(len(walls), 1) / 60, 1),
               "jobs": max((r.get("jobs", 1) for r in runs), default=1)}  # fmt: skip
    return figures | ({"wall_minutes": round(wall_s / 60, 1)} if wall_s is not None else {})


def budget_figures(runs: dict, folder: Path, buckets: tuple[str, ...] = BUDGET_BUCKETS) -> dict[str, list[float]]:
    """Per bucket, ``[mean, 95 % half-width]`` over the seeds of ``runs`` (run folders ``folder/seed<s>``) of the
    mean L1 budget share over training."""
    def one(bucket: str) -> list[float]:
        series = (budget_series(folder / f"seed{s}", bucket) for s in runs)
        return seed_interval([sum(v for _, v in pts) / len(pts) for pts in series if pts])

    return {b: one(b) for b in buckets}


def key_figures(results, specs, out: Path) -> dict:
    """The figures of a head-to-head report for its artefact: per estimator, ``[mean, 95 % half-width]`` over
    seeds of the final mean accuracy over levels, its change from step 0, the final accuracy and pass@k per
    level and overall, the mean L1 budget share per bucket, and the seed-paired difference of the final mean
    against GRPO (``[mean, half-width, seeds]``) and of each pass@k (``[mean, half-width]``); the base model's
    accuracies (step 0, one run per seed) and the range of its mean over levels across seeds."""
    base = base_runs(results)
    levels = list(base[0]["initial"]["by_difficulty"]) if base else []
    base_means = [r["initial"]["mean_over_levels"] for r in base]
    figures = {"base": {"mean_over_levels": seed_interval(base_means),
                        "mean_over_levels_range": [min(base_means), max(base_means)] if base else None,
                        "by_difficulty": {lv: seed_interval([r["initial"]["by_difficulty"][lv] for r in base])
                                          for lv in levels}},
               "estimators": {}}  # fmt: skip
    ref = next((s.label for s in specs if s.name == "GRPO" and not s.init_args and results[s.label]), None)
    for spec in specs:
        runs = results[spec.label]
        if not runs:
            continue
        finals = [r["final"] for r in runs.values()]
        ks = list(finals[0]["pass_at_k"])

        figures["estimators"][spec.label] = {
            "seeds": sorted(runs),
            "mean_over_levels": seed_interval([f["mean_over_levels"] for f in finals]),
            "change": seed_interval([r["final"]["mean_over_levels"] - r["initial"]["mean_over_levels"]
                                     for r in runs.values()]),
            "by_difficulty": {lv: seed_interval([f["by_difficulty"][lv] for f in finals]) for lv in levels},
            "pass_at_k": {k: seed_interval([f["pass_at_k"][k] for f in finals]) for k in ks},
            "budget_l1": budget_figures(runs, out / spec.slug),
            "vs_grpo": list(paired(runs, results[ref])) if ref and spec.label != ref else None,
            "pass_at_k_vs_grpo": {k: list(paired(runs, results[ref], lambda r, k=k: r["final"]["pass_at_k"][k]))[:2]
                                  for k in ks} if ref and spec.label != ref else None,
        }  # fmt: skip
    return figures
