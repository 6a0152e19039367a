"""Head-to-head on a scalar reward (issue 26): GRPO, Dr.GRPO and SoftmaxGRPO on sort 3..9 with edit similarity.

The protocol below (``PROTOCOL``) was fixed and committed before the full run, together with the pilot that
fixed SoftmaxGRPO's temperature; change it and you run a different benchmark. It drives
``benchmarks/head_to_head.py`` (run folders, resuming, ``--jobs``, one torch thread per run) as
``head_to_head_tail.py`` does, with ``configs/sort_tail_edit.yaml``: the sort 3..9 tail of issue 15 with the
reward replaced by the normalised Levenshtein similarity to the sorted digits (``EditSimilarity``, in [0, 1]).
Success, and so validation accuracy, is exact match. The paper's 0.6 word F1 + 0.4 word ROUGE-L mix is not
used: a sort answer is a single word ("1234"), so both word metrics equal exact match, a binary reward.

Roster: GRPO (the reference), Dr.GRPO, SoftmaxGRPO at a temperature fixed before the run from the step-0
reward spread, and SoftmaxGRPO with the per-group ESS rule (``temperature_rule="ess"``, target 0.5: each group's
tau makes the softmax weights' effective sample size half the group). Same warm start, same seeds, identical
step-0 rollouts; 12 seeds x 200 steps, 16 prompts x G = 8 per step.

The temperature rule (stated before the pilot ran): tau = the mean, over the non-constant groups of a pilot
of the step-0 policy, of the within-group sample std of the reward, rounded to two significant digits. The
pilot (``--pilot``) trains 25 steps at lr 1e-30 (the update rounds to no change: the exported weights equal
the warm start's bit for bit) and logs all 16 groups of every step, 400 groups, seed 1000 (not a benchmark
seed). Its figures are in ``PROTOCOL["pilot"]``.

Primary metric (stated before the runs): final validation exact-match accuracy averaged over levels 7, 8, 9
(100 prompts x 8 samples each), as the seed-paired difference (estimator - GRPO): mean, 95 % Student-t
half-width h = t(0.975, n - 1) sd(d) / sqrt(n), and the two-sided paired t-test p-value, Holm-corrected over
the three comparisons (family-wise error 0.05). Secondary: the log-MGF objective ``train/log_mgf`` (mean over
groups of tau log mean_j exp(r_j / tau) at the fixed tau, every estimator) and the mean edit similarity
``train/reward``, each averaged over the last 50 training steps, paired against GRPO the same way.

    python benchmarks/head_to_head_scalar.py              # the full protocol, resumes; publishes the report
    python benchmarks/head_to_head_scalar.py --report-only
    python benchmarks/head_to_head_scalar.py --pilot      # the step-0 pilot that fixed the temperature
    python benchmarks/head_to_head_scalar.py --quick      # 2 estimators x 1 seed x 2 steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import head_to_head_tail as tail  # noqa: E402
from benchmarks._common import HelpFormatter, markdown_table  # noqa: E402
from benchmarks._h2h_stats import BUDGET_BUCKETS, budget_figures, ci, fmt, run_time_figures  # noqa: E402
from benchmarks.artefact import REPORTS, publish  # noqa: E402
from benchmarks.figures.h2h import SCALAR_DEVIATIONS, deviations_section  # noqa: E402
from sgrpo.eval.report import read_metrics  # noqa: E402

TAU = 0.16  # the pilot's: mean within-group std 0.1561 over 395 non-constant step-0 groups, two digits
ESS_SPEC = 'estimators.SoftmaxGRPO:{"temperature": null, "temperature_rule": "ess", "target_ess": 0.5}'

#: fixed 2026-12-01 before the full run (issue 26); the README reports the run of exactly this
PROTOCOL = {
    "config": "configs/sort_tail_edit.yaml",
    "estimators": ["estimators.GRPO", "estimators.DrGRPO", f'estimators.SoftmaxGRPO:{{"temperature": {TAU}}}',
                   ESS_SPEC],  # fmt: skip
    "seeds": list(range(12)),
    "steps": 200,
    "val_every": 100,
    "val_samples": 8,
    "group_size": 8,
    "primary_levels": ["7", "8", "9"],
    "alpha": 0.05,
    "secondary_window": 50,
    "extra": f"--model.log_mgf_temperature={TAU}",
    "out": "benchmarks/results/head_to_head_scalar",
    "pilot": {
        "seed": 1000, "steps": 25, "groups": 400, "constant_groups": 5, "mean_reward": 0.7292,
        "std_mean": 0.1561, "std_median": 0.1477, "range_mean": 0.4314, "tau": TAU,
        "ess_at_tau_median": 0.6824, "ess_rule_tau_median": 0.0872,
        "rule": "tau = mean over non-constant step-0 groups of the within-group sample std of the reward, "
                "two significant digits",
    },  # fmt: skip
}
QUICK = PROTOCOL | {
    "estimators": ["estimators.GRPO", ESS_SPEC],
    "seeds": [0],
    "steps": 2,
    "val_every": 1,
    "val_samples": 2,
    "group_size": 2,
    "secondary_window": 2,
    "extra": tail.QUICK["extra"] + f" --model.log_mgf_temperature={TAU}",
    "out": "benchmarks/results/head_to_head_scalar_quick",
}
SECONDARY = {"train/log_mgf": f"log-MGF objective at tau = {TAU}", "train/reward": "mean edit similarity"}


# ---------------------------------------------------------------------------------------------- maths
def paired_test(diffs: list[float]) -> tuple[float, float, float]:
    """Mean, 95 % t half-width and two-sided paired t-test p-value of seed-paired differences (nan for n < 2;
    p = 0 for identical non-zero differences, 1 for all-zero ones)."""
    from scipy.stats import t as student_t

    mean, half = ci(diffs)
    n = len(diffs)
    if n < 2:
        return mean, half, math.nan
    sd = float(torch.tensor(diffs, dtype=torch.float64).std())
    if sd == 0:
        return mean, half, 0.0 if mean != 0 else 1.0
    return mean, half, float(2 * student_t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the i-th smallest of m becomes max_{j <= i} min(1, (m - j + 1) p_(j)).

    A hypothesis is rejected at family-wise level alpha when its adjusted p-value is <= alpha; nan stays nan
    and does not count in m.
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    adjusted, running = [math.nan] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[i] = running
    return adjusted


def pilot_stats(rewards: torch.Tensor) -> dict:
    """The step-0 spread of ``rewards`` ``[N, G]`` (one row a group) and the temperature it fixes."""
    from estimators.softmax_grpo import ess_fraction, ess_temperatures

    r = rewards.to(torch.float64)
    varied = r.amax(-1) > r.amin(-1)
    std, spread = r[varied].std(-1), (r.amax(-1) - r.amin(-1))[varied]
    tau = float(f"{std.mean().item():.2g}")
    return {
        "groups": len(r), "constant_groups": int((~varied).sum()), "mean_reward": r.mean().item(),
        "std_mean": std.mean().item(), "std_median": std.median().item(), "range_mean": spread.mean().item(),
        "tau": tau, "ess_at_tau_median": ess_fraction(r[varied], tau).median().item(),
        "ess_rule_tau_median": ess_temperatures(r[varied], 0.5).median().item(),
    }  # fmt: skip


def tail_mean(run_dir: Path, key: str, window: int) -> float:
    """Mean of ``key`` over the last ``window`` logged training steps of a run (nan if never logged)."""
    series = read_metrics(run_dir / "lightning_logs" / "version_0" / "metrics.csv").get(key, [])
    values = [v for _, v in series[-window:]]
    return sum(values) / len(values) if values else math.nan


# ---------------------------------------------------------------------------------------------- report
def comparisons(results, specs, proto, metric) -> list[dict]:
    """Per estimator after the reference: n, mean, 95 % half-width, p and Holm-adjusted p of metric - GRPO's."""
    ref = specs[0].label
    rows = []
    for spec in specs[1:]:
        common = sorted(set(results[spec.label]) & set(results[ref]))
        diffs = [metric(spec, s) - metric(specs[0], s) for s in common]
        mean, half, p = paired_test(diffs) if diffs else (math.nan, math.nan, math.nan)
        rows.append({"estimator": spec.label, "n": len(diffs), "delta": mean, "half_width": half, "p": p})
    for row, adjusted in zip(rows, holm([r["p"] for r in rows]), strict=True):
        row["p_holm"] = adjusted
        row["significant"] = bool(adjusted <= proto["alpha"])
    return rows


def comparison_table(rows, values, unit: float, unit_name: str, alpha: float, digits: int = 2) -> str:
    header = ["estimator", "value (mean ± 95 % CI)", "seeds", "paired seeds", f"Δ vs GRPO ({unit_name})",
              "95 % half-width", "95 % CI", "p (paired t)", "p (Holm)", f"significant (Holm, {alpha})"]  # fmt: skip
    table = []
    for label, cell, n in values:
        row = next((r for r in rows if r["estimator"] == label), None)
        if row is None:
            table.append([label, cell, n, "", "(reference)", "", "", "", "", ""])
            continue
        d, h = unit * row["delta"], unit * row["half_width"]
        if math.isnan(h):  # fewer than two paired seeds: no interval, no test
            delta = "-" if math.isnan(d) else f"{d:+.{digits}f}"
            table.append([label, cell, n, row["n"], delta, "-", "-", "-", "-", "-"])
            continue
        lo, hi = f"{d - h:+.{digits}f}", f"{d + h:+.{digits}f}"
        table.append([label, cell, n, row["n"], f"{d:+.{digits}f}", f"± {h:.{digits}f}", f"[{lo}, {hi}]",
                      f"{row['p']:.3f}", f"{row['p_holm']:.3f}", "yes" if row["significant"] else "no"])  # fmt: skip
    return markdown_table(header, table)


def plain(values: list[float]) -> str:
    mean, half = ci(values) if values else (math.nan, math.nan)
    return f"{mean:.4f}" + ("" if math.isnan(half) else f" ± {half:.4f}")


def build_report(results, specs, proto, out: Path) -> tuple[list[str], dict]:
    levels = proto["primary_levels"]

    def acc(spec, seed):
        return tail.primary(results[spec.label][seed], levels)

    primary_rows = comparisons(results, specs, proto, acc)
    cells = [(s.label, fmt([acc(s, k) for k in results[s.label]]), len(results[s.label])) for s in specs]
    sections = [
        f"## Primary: final exact-match accuracy on levels {', '.join(levels)}, paired against GRPO\n\n"
        + comparison_table(primary_rows, cells, 100, "pts", proto["alpha"])
        + "\n\nHolm's step-down correction over the three comparisons keeps the family-wise error at "
        f"{proto['alpha']}; an interval is the uncorrected 95 % paired t-interval."
    ]
    result = {"primary": {"rows": primary_rows, "per_estimator": {}}, "secondary": {}}
    for spec in specs:
        per_seed = {str(k): acc(spec, k) for k in sorted(results[spec.label])}
        result["primary"]["per_estimator"][spec.label] = {"per_seed": per_seed, "mean": ci(list(per_seed.values()))}
    cache: dict[tuple[str, int, str], float] = {}
    for key, name in SECONDARY.items():

        def metric(spec, seed, key=key):
            if (spec.label, seed, key) not in cache:
                run_dir = out / spec.slug / f"seed{seed}"
                cache[spec.label, seed, key] = tail_mean(run_dir, key, proto["secondary_window"])
            return cache[spec.label, seed, key]

        rows = comparisons(results, specs, proto, metric)
        cells = [(s.label, plain([metric(s, k) for k in results[s.label]]), len(results[s.label])) for s in specs]
        result["secondary"][key] = {"rows": rows, "values": {c[0]: c[1] for c in cells}}
        sections.append(
            f"## Secondary: {name} (`{key}`, mean over the last {proto['secondary_window']} training steps)\n\n"
            + comparison_table(rows, cells, 1, "reward units", proto["alpha"], digits=4)
        )
    pass_text, result["pass_at_k"] = tail.pass_section(results, specs, proto)
    sections.append("## pass@1 and pass@k by difficulty\n\n" + pass_text)
    return sections, result


def protocol_section(proto, quick: bool) -> str:
    pilot = proto["pilot"]
    return (
        ("**Quick mode (smoke test, not the protocol)**. " if quick else "")
        + f"Config `{proto['config']}` (edit-similarity reward, exact-match success), {proto['steps']} steps, "
        f"validation every {proto['val_every']} steps and before training, {proto['val_samples']} samples per "
        f"validation prompt, group size {proto['group_size']}, seeds {proto['seeds'][0]}..{proto['seeds'][-1]} "
        f"({len(proto['seeds'])}), roster " + ", ".join(f"`{e}`" for e in proto["estimators"]) + ". "
        f"Fixed temperature: {pilot['rule']}. Pilot of the step-0 policy ({pilot['groups']} groups, seed "
        f"{pilot['seed']}, {pilot['constant_groups']} constant): mean reward {pilot['mean_reward']:.4f}, "
        f"within-group std mean {pilot['std_mean']:.4f} (median {pilot['std_median']:.4f}), mean range "
        f"{pilot['range_mean']:.4f}, so **tau = {pilot['tau']}**; at that tau the median group's softmax ESS is "
        f"{pilot['ess_at_tau_median']:.2f} of the group, and the ESS rule (target 0.5) picks a median tau of "
        f"{pilot['ess_rule_tau_median']:.4f}. Primary and secondary metrics as stated in "
        "`benchmarks/head_to_head_scalar.py`, fixed before the run."
    )


# ---------------------------------------------------------------------------------------------- running
def run_pilot(proto, out: Path) -> dict:
    """Sample ``steps`` x 16 groups from the step-0 policy (lr 1e-30: no change) and measure their spread."""
    pilot, run_dir = proto["pilot"], out / "pilot"
    if not (run_dir / "completions.jsonl").exists():
        command = [
            sys.executable, "-m", "sgrpo.fit", "--config", str(_ROOT / proto["config"]),
            "--model.optimizer.init_args.lr=1e-30", f"--trainer.max_steps={pilot['steps']}",
            "--validate_before=false", "--report=false", "--trainer.limit_val_batches=0",
            "--model.log_completions_every=1", "--model.log_completions_groups=16",
            f"--seed_everything={pilot['seed']}", f"--model.seed={pilot['seed']}",
            f"--trainer.default_root_dir={run_dir}", "--trainer.enable_progress_bar=false",
        ]  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT)}
        subprocess.run(command, cwd=_ROOT, env=env, check=True, capture_output=True)
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups[row["step"], row["group"]].append(row["reward"])
    stats = pilot_stats(torch.tensor(list(groups.values())))
    (out / "pilot.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 estimators x 1 seed x 2 steps (the test suite's)")
    parser.add_argument("--pilot", action="store_true", help="only the step-0 pilot that fixed the temperature")
    parser.add_argument("--out", type=Path, default=None, help="run folders and report (default: the protocol's)")
    parser.add_argument("--reports", type=Path, default=REPORTS, help="where the artefact is published")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--report-only", action="store_true", help="no training: report the finished runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    opts = parse_args(argv)
    proto = QUICK if opts.quick else PROTOCOL
    out = (opts.out or _ROOT / proto["out"]).resolve()
    if opts.pilot:
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run_pilot(proto, out), indent=1))
        return out / "pilot.json"
    results, specs, path = tail.run_protocol(proto, out, opts.jobs, opts.report_only)
    if not any(results.values()):
        return path
    sections, result = build_report(results, specs, proto, out)
    ours = ["## Protocol\n\n" + protocol_section(proto, opts.quick), *sections]
    title, _, rest = path.read_text().partition("\n## Setup")
    title = title.replace("the quickstart task", "sort 3..9 with an edit-similarity reward")
    text = title + "\n" + "\n\n".join(ours) + "\n\n## Setup" + rest
    path.write_text(text)
    (out / "protocol.json").write_text(json.dumps(proto, indent=1) + "\n")
    finished = sum(len(runs) for runs in results.values())
    hard_pass = result.get("pass_at_k", {}).get("hard_vs_grpo", {})  # the docs quote Δ pass@k on the primary levels
    result["pass_primary_vs_grpo"] = {label: [st["mean"], st["half"]] for label, st in hard_pass.items()}
    result["budget_l1"] = {s.label: budget_figures(results[s.label], out / s.slug, ("unsolved", *BUDGET_BUCKETS))
                           for s in specs if results[s.label]}  # fmt: skip
    result["run_time"] = run_time_figures(results)
    result |= {"protocol": proto, "runs_finished": finished, "runs_planned": len(specs) * len(proto["seeds"]),
               "deviations": [] if opts.quick else SCALAR_DEVIATIONS}  # fmt: skip
    name = "scalar_head_to_head" + ("_quick" if opts.quick else "")
    command = ".venv/bin/python benchmarks/head_to_head_scalar.py" + (" --quick" if opts.quick else "")
    report = text.split("\n## Figures")[0].rstrip("\n") + "\n\n" + deviations_section(result)
    folder = publish(name, result, report, command, opts.reports)
    print("\n\n".join(ours) + f"\n\nreport: {path}\nartefact: {folder}")
    return path


if __name__ == "__main__":
    main()
