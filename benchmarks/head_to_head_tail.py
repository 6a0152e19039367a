"""Head-to-head with power (issue 15): eight estimators on a sort mixture with a long tail of hard prompts.

The protocol below (``PROTOCOL``) was fixed and committed before the full run; change it and you run a
different benchmark. It drives ``benchmarks/head_to_head.py`` (same run folders, resuming, ``--jobs``,
one torch thread per run) with ``configs/sort_tail.yaml``: the quickstart warm start on ``sort`` levels
3..9 (balanced), which it solves at 49, 32, 19, 11, 10, 2.3 and 0.2 % (levels 3..9, sampled, measured
before the protocol was fixed). Roster: GRPO, Dr.GRPO, RLOO, MaxRL (practical) and SoftmaxGRPO at
tau 0.25, 0.5, 1, 2; identical rollouts per step (16 prompts x G = 8), same warm start, same seeds.

Primary metric (stated before the runs): final validation accuracy averaged over the three hardest levels
(7, 8, 9), 100 prompts x 8 samples each; the test is the seed-paired difference (estimator - GRPO) with a
95 % Student-t interval over seeds, target half-width <= 1.5 points. With the differences d_s over n
seeds, half-width h = t(0.975, n - 1) sd(d) / sqrt(n); the power note gives the smallest n with
t(0.975, n - 1) sd(d) / sqrt(n) <= 1 point, at the measured sd. Secondary: pass@1 and unbiased pass@k
(k = 1..G) per level.

Theory against practice: the measured L1 budget shares (``train/budget/l1/<bucket>``, mean over steps and
seeds) against two predictions, each the trapezoid average over the run's validations (steps 0, 100,
200) of the expected shares

    share_b = sum_K P(K) B1(K) [K/G in b] / sum_K P(K) B1(K),    B1(K) = sum_i |A_i| of the binary group
                                                                  with K successes (the estimator's own table)

with P(K) either the validation success-count histogram (8 samples per prompt = G, so it samples the law
of K in a training group) or the binomial mixture mean_l Bin(G, p_l) at the measured per-level accuracies
p_l (levels homogeneous). And the estimator's ``population_weight`` c_G(p_l) at those accuracies: the
share sum_{l hard} c_G(p_l) / sum_l c_G(p_l) of the expected update (weight on grad p) given to levels 7-9.

    python benchmarks/head_to_head_tail.py              # the full protocol (37.5 min on 2 shared cores), resumes
    python benchmarks/head_to_head_tail.py --quick      # 2 estimators x 1 seed x 2 steps: a smoke test

The report, with its figures as ``result``, is published to ``benchmarks/reports/head_to_head_tail/``
(``benchmarks/artefact.py``; ``--no-publish`` skips it) under the protocol's command: ``--report-only``
publishes the finished runs' figures as the full protocol would, since they are its runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import artefact  # noqa: E402
from benchmarks import head_to_head as h2h  # noqa: E402
from benchmarks._common import HelpFormatter, markdown_table  # noqa: E402
from benchmarks._h2h_stats import (  # noqa: E402
    budget_series,
    ci,
    fmt,
    holm,
    key_figures,
    paired_p,
    run_time_figures,
    seed_interval,
)
from benchmarks._tail_maths import (  # noqa: E402
    binomial_law,
    expected_shares,
    hard_pass,
    hard_weight_share,
    primary,
    seeds_needed,
    trapezoid,
)
from estimators import BUCKETS  # noqa: E402

#: fixed 2026-12-01 before the full run (issue 15); the README reports the run of exactly this
PROTOCOL = {
    "config": "configs/sort_tail.yaml",
    "estimators": [
        "estimators.GRPO",
        "estimators.DrGRPO",
        "estimators.RLOO",
        'estimators.MaxRL:{"variant": "practical"}',
        'estimators.SoftmaxGRPO:{"temperature": 0.25}',
        'estimators.SoftmaxGRPO:{"temperature": 0.5}',
        'estimators.SoftmaxGRPO:{"temperature": 1.0}',
        'estimators.SoftmaxGRPO:{"temperature": 2.0}',
    ],
    "seeds": list(range(12)),
    "steps": 200,
    "val_every": 100,
    "val_samples": 8,
    "group_size": 8,
    "primary_levels": ["7", "8", "9"],
    "target_half_width": 0.015,
    "extra": "",
    "out": "benchmarks/results/head_to_head_tail",
}
QUICK = PROTOCOL | {
    "estimators": ["estimators.GRPO", 'estimators.SoftmaxGRPO:{"temperature": 0.5}'],
    "seeds": [0],
    "steps": 2,
    "val_every": 1,
    "val_samples": 2,
    "group_size": 2,
    "extra": "--model.group_size=2 --model.prompts_per_step=2 --model.task.init_args.num_validation=14 "
    "--model.val_prompts_per_batch=14",
    "out": "benchmarks/results/head_to_head_tail_quick",
}


# ---------------------------------------------------------------------------------------------- report
def paired_stats(results, specs, metric) -> dict[str, dict]:
    """Per estimator but GRPO (first in the roster): the seed-paired difference against GRPO of ``metric(run)``:
    mean, 95 % half-width, sd, seeds, t-test p and Holm's p over the comparisons (``_h2h_stats.holm``)."""
    ref, stats = specs[0].label, {}
    for spec in specs[1:]:
        common = sorted(set(results[spec.label]) & set(results[ref]))
        if not common:
            continue
        diffs = [metric(results[spec.label][s]) - metric(results[ref][s]) for s in common]
        mean, half = ci(diffs)
        sd = float(torch.tensor(diffs, dtype=torch.float64).std()) if len(diffs) > 1 else math.nan
        stats[spec.label] = {"mean": mean, "half": half, "sd": sd, "seeds": len(diffs), "p": paired_p(diffs)}
    for label, adjusted in holm({k: v["p"] for k, v in stats.items()}).items():
        stats[label]["holm_p"] = adjusted
    return stats


def _verdict(stat: dict) -> str:
    """``yes (Holm)``: Holm p <= 0.05; ``yes (95 % only)``: only the unadjusted interval excludes 0; ``no``."""
    if math.isnan(stat["half"]):
        return ""
    return "yes (Holm)" if stat["holm_p"] <= 0.05 else "yes (95 % only)" if abs(stat["mean"]) > stat["half"] else "no"


def primary_section(results, specs, proto) -> tuple[str, dict]:
    levels, target = proto["primary_levels"], proto["target_half_width"]
    stats = paired_stats(results, specs, lambda r: primary(r, levels))
    base = [primary({"final": r["initial"]}, levels) for r in h2h.base_runs(results)]  # step 0, one run per seed
    rows, figures = [["base model (step 0)", fmt(base), len(base), *[""] * 8]], {"base": seed_interval(base)}
    for spec in specs:
        runs = results[spec.label]
        if not runs:
            continue
        values = [primary(r, levels) for r in runs.values()]
        figures[spec.label] = {"accuracy": seed_interval(values), "vs_grpo": stats.get(spec.label)}
        row = [spec.label, fmt(values), len(values)]
        if spec.label in stats:
            st = stats[spec.label]
            need = seeds_needed(st["sd"], 0.01) if not math.isnan(st["sd"]) else None
            st["seeds_for_1pt"] = need
            lo, hi = 100 * (st["mean"] - st["half"]), 100 * (st["mean"] + st["half"])
            row += [f"{100 * st['mean']:+.2f}", f"± {100 * st['half']:.2f}", f"[{lo:+.2f}, {hi:+.2f}]",
                    f"{st['p']:.3f}", f"{st['holm_p']:.3f}", _verdict(st), f"{100 * st['sd']:.2f}",
                    need if need is not None else "> 10,000"]  # fmt: skip
        else:
            row += ["(reference)", "", "", "", "", "", "", ""]
        rows.append(row)
    header = ["estimator", f"accuracy on levels {', '.join(levels)}", "seeds", "Δ vs GRPO (pts)", "95 % half-width",
              "95 % CI", "p", "Holm p", "significant", "sd of Δ (pts)", "seeds for ± 1 pt"]  # fmt: skip
    finite = [st["half"] for st in stats.values() if not math.isnan(st["half"])]
    worst = max(finite) if finite else math.nan
    verdict = (
        "no interval (fewer than 2 paired seeds)"
        if math.isnan(worst)
        else f"largest achieved half-width **± {100 * worst:.2f} pts** against the target ± {100 * target:.1f}: "
        + ("met" if worst <= target else "**not met**")
    )
    text = (
        markdown_table(header, rows)
        + f'\n\nPower: {verdict}. "seeds for ± 1 pt" = smallest n with t(0.975, n-1) sd / sqrt(n) <= 1 pt at the '
        f"measured sd of the paired differences. {len(stats)} comparisons against one reference: at 95 % each, "
        f'if none differed, about {100 * (1 - 0.95 ** len(stats)):.0f} % of such tables would show a spurious "yes". '
        "p: two-sided paired t-test; Holm p: Holm's step-down adjustment over these comparisons (family-wise "
        'error 5 %: "yes (Holm)" where Holm p <= 0.05; "yes (95 % only)": the unadjusted interval excludes 0, '
        "Holm's test does not)."
    )
    return text, figures


def pass_section(results, specs, proto) -> tuple[str, dict]:
    first = next(r for runs in results.values() for r in runs.values())
    by_level = first["final"].get("pass_at_k_by_difficulty") or {}
    if not by_level:
        return "(these runs did not log pass@k by difficulty)", {}
    levels = list(by_level)
    kmax = list(by_level[levels[0]])[-1]
    rows, figures = [], {"k": kmax, "by_level": {}}
    for spec in specs:
        runs = list(results[spec.label].values())
        if runs:
            cells = {lv: [[r["final"]["pass_at_k_by_difficulty"][lv][k] for r in runs] for k in ("1", kmax)]
                     for lv in levels}  # fmt: skip
            figures["by_level"][spec.label] = {lv: [seed_interval(c) for c in pair] for lv, pair in cells.items()}
            rows.append([spec.label, *(f"{fmt(one)} / {fmt(top)}" for one, top in cells.values())])
    hard = proto["primary_levels"]
    stats = paired_stats(results, specs, lambda r: hard_pass(r, hard, kmax))
    figures["hard_vs_grpo"] = stats
    lines = [f"| {label} | {100 * st['mean']:+.2f} ± {100 * st['half']:.2f} | {st['p']:.3f} | {st['holm_p']:.3f} | "
             f"{_verdict(st)} |" for label, st in stats.items() if st["seeds"] > 1]  # fmt: skip
    table2 = (
        f"\n\nPaired Δ pass@{kmax} on levels {', '.join(hard)} vs GRPO (pts, mean ± 95 % half-width; p: paired "
        "t-test; Holm p over these comparisons):\n\n"
        f"| estimator | Δ pass@{kmax} | p | Holm p | significant |\n|---|---:|---:|---:|---|\n" + "\n".join(lines)
        if lines
        else ""
    )
    text = (
        f"Final pass@1 / pass@{kmax} per level (unbiased, {kmax} samples per prompt; mean ± 95 % CI over seeds):\n\n"
        + markdown_table(["estimator", *(f"level {lv}" for lv in levels)], rows)
        + table2
    )
    return text, figures


def budget_section(results, specs, proto, out: Path) -> tuple[str, dict]:
    g, hard = proto["group_size"], proto["primary_levels"]
    rows, figures = [], {}
    for spec in specs:
        runs = results[spec.label]
        if not runs:
            continue
        est = h2h_estimator(spec)
        measured = {b: [] for b in BUCKETS}
        from_hist, from_levels, c_share = [], [], []
        for seed, run in runs.items():
            for b, value in measured_shares(out / spec.slug / f"seed{seed}").items():
                measured[b].append(value)
            vals = run["history"]
            if all(v.get("success_counts") for v in vals):
                from_hist.append(trapezoid([expected_shares(est, g, torch.tensor(v["success_counts"])) for v in vals]))
            from_levels.append(trapezoid([expected_shares(est, g, binomial_law(list(v["by_difficulty"].values()), g))
                                          for v in vals]))  # fmt: skip
            c_share.append(trapezoid([{"s": hard_weight_share(est, g, v["by_difficulty"], hard)} for v in vals])["s"])
        meas = {b: sum(v) / len(v) for b, v in measured.items() if v}
        if not meas:
            continue
        hist = {b: sum(d[b] for d in from_hist) / len(from_hist) for b in BUCKETS} if from_hist else {}
        lev = {b: sum(d[b] for d in from_levels) / len(from_levels) for b in BUCKETS}
        gap = max(abs(meas[b] - hist[b]) for b in meas) if hist else math.nan
        gap_lev = max(abs(meas[b] - lev[b]) for b in meas)

        def cell(b, meas=meas, hist=hist, lev=lev):
            return f"{100 * meas.get(b, math.nan):.1f} / {100 * hist.get(b, math.nan):.1f} / {100 * lev[b]:.1f}"

        share = sum(c_share) / len(c_share)
        figures[spec.label] = {"measured": meas, "from_histogram": hist, "from_levels": lev, "max_gap_histogram": gap,
                               "max_gap_levels": gap_lev, "c_share_hard": share}  # fmt: skip
        rows.append([spec.label, cell("hard"), cell("mid_hard"), cell("half"), cell("near_solved"),
                     f"{100 * gap:.1f}", f"{100 * gap_lev:.1f}", f"{100 * share:.1f}"])  # fmt: skip
    header = ["estimator", "hard", "mid-hard", "half", "near-solved", "max gap, histogram (pts)",
              "max gap, levels (pts)", f"c_G share of levels {', '.join(hard)}"]  # fmt: skip
    text = (
        "L1 share of |A| per bucket, **measured** during training (mean over steps and seeds) / **predicted** from "
        "the validation success-count histogram / **predicted** from Bin(G, p_level) at the measured per-level "
        'accuracies (both: trapezoid average over the run\'s validations, mean over seeds), percent. "max gap": '
        "largest |measured - predicted| over all seven buckets. Last column: the hard levels' share of "
        "sum_l c_G(p_l) (the estimator's population_weight at the measured per-level accuracies).\n\n"
        + markdown_table(header, rows)
        + "\n\nA per-step share is a ratio of masses over that step's 16 groups, averaged over steps; the "
        "predictions are ratios of expectations, so a small gap remains even when the theory holds. What the "
        "histogram column tests: with a binary reward a group's |A| are a fixed function of its success count K "
        "(the estimator's table B1(K)), so measured and histogram-predicted shares are the same function of two "
        "success-count histograms (training groups against validation samples); their agreement says the two "
        "histograms agree, not that the estimator's theory holds beyond its own table."
    )
    return text, figures


def measured_shares(run_dir: Path) -> dict[str, float]:
    """Mean over training steps of ``train/budget/l1/<bucket>``, over the steps with any advantage mass
    (a step whose groups are all constant logs 0 in every bucket and carries no budget)."""
    per_step: dict[int, dict[str, float]] = {}
    for b in BUCKETS:
        for step, value in budget_series(run_dir, b):
            per_step.setdefault(step, {})[b] = value
    steps = [v for v in per_step.values() if sum(v.values()) > 0.5]
    return {b: sum(v.get(b, 0.0) for v in steps) / len(steps) for b in BUCKETS} if steps else {}


def h2h_estimator(spec):
    import importlib

    module, _, name = spec.class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.init_args)


def protocol_section(proto, quick: bool) -> str:
    return (
        ("**Quick mode (smoke test, not the protocol)**. " if quick else "")
        + f"Config `{proto['config']}`, {proto['steps']} steps, validation every {proto['val_every']} steps and "
        f"before training, {proto['val_samples']} samples per validation prompt, group size {proto['group_size']}, "
        f"seeds {proto['seeds'][0]}..{proto['seeds'][-1]} ({len(proto['seeds'])}), roster "
        + ", ".join(f"`{e}`" for e in proto["estimators"])
        + f". Primary metric: final accuracy averaged over levels {', '.join(proto['primary_levels'])}; "
        f"seed-paired difference against GRPO with a 95 % t-interval, target half-width ± "
        f"{100 * proto['target_half_width']:.1f} pts. Fixed in `benchmarks/head_to_head_tail.py` before the run."
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 estimators x 1 seed x 2 steps (the test suite's)")
    parser.add_argument("--out", type=Path, default=None, help="run folders and report (default: the protocol's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--report-only", action="store_true", help="no training: report the finished runs")
    return artefact.publish_option(parser).parse_args(argv)


def run_protocol(proto: dict, out: Path, jobs: int, report_only: bool):
    """Run (or resume, or with ``report_only`` read) a protocol's runs through ``benchmarks/head_to_head.py``
    and write its report: ``(results, specs, report path)``."""
    args = h2h.parse_args(h2h_argv(proto, out, jobs, report_only))
    specs = h2h.parse_estimators(args.estimators)
    for spec in specs:
        spec.check()
    results = h2h.run_all(specs, args)
    return results, specs, h2h.write_report(results, specs, args)


def h2h_argv(proto: dict, out: Path, jobs: int, report_only: bool) -> list[str]:
    """``benchmarks/head_to_head.py`` arguments of a protocol (one torch thread per run)."""
    return [
        "--estimators", *proto["estimators"], "--seeds", *map(str, proto["seeds"]),
        "--steps", str(proto["steps"]), "--val-every", str(proto["val_every"]),
        "--val-samples", str(proto["val_samples"]), "--config", str(_ROOT / proto["config"]),
        "--jobs", str(jobs), "--threads", "1", "--out", str(out), f"--extra={proto['extra']}",
        *(["--report-only"] if report_only else []),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    opts = parse_args(argv)
    proto = QUICK if opts.quick else PROTOCOL
    out = (opts.out or _ROOT / proto["out"]).resolve()
    results, specs, path = run_protocol(proto, out, opts.jobs, opts.report_only)
    if not any(results.values()):
        return path
    primary_text, primary_figures = primary_section(results, specs, proto)
    (pass_text, pass_figures), (budget_text, budget_figures) = pass_section(results, specs, proto), budget_section(
        results, specs, proto, out)  # fmt: skip
    done, planned = sum(map(len, results.values())), len(specs) * len(proto["seeds"])
    partial = f"\n\n**Partial: {done} of {planned} runs finished**; every table is over those runs." * (done < planned)
    ours = [
        "## Protocol\n\n" + protocol_section(proto, opts.quick) + partial,
        f"## Primary: final accuracy on levels {', '.join(proto['primary_levels'])}, paired against GRPO\n\n"
        + primary_text,
        "## pass@1 and pass@k by difficulty\n\n" + pass_text,
        "## Gradient budget: theory against practice\n\n" + budget_text,
    ]
    title, _, rest = path.read_text().partition("\n## Setup")
    text = title.replace("the quickstart task", "the sort 3..9 tail") + "\n" + "\n\n".join(ours) + "\n\n## Setup" + rest
    path.write_text(text)
    (out / "protocol.json").write_text(json.dumps(proto, indent=1) + "\n")
    figures = {"protocol": proto, "runs_finished": done, "runs_planned": planned, "primary": primary_figures,
               "runs": key_figures(results, specs, out), "pass": pass_figures, "budget": budget_figures,
               "run_time": run_time_figures(results)}  # fmt: skip
    artefact.publish_run(opts, "head_to_head_tail" + "_quick" * opts.quick, figures, text, __file__,
                         ["--quick"] if opts.quick else [])  # fmt: skip
    print("\n\n".join(ours) + f"\n\nreport: {path}")
    return path


if __name__ == "__main__":
    main()
