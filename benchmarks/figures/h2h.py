"""Renders of the quickstart and scalar-reward head-to-head artefacts (head_to_head, scalar_head_to_head)."""

from __future__ import annotations

from benchmarks.figures._fmt import (
    bold,
    interval,
    label,
    overlap,
    pct,
    pct_ci,
    pts_ci,
    pval,
    spread,
    table,
    words,
    wrap,
)


def head_to_head(stamp: dict) -> str:
    r = stamp["result"]
    est, base, rt = r["estimators"], r["base"], r["run_time"]
    levels = list(base["by_difficulty"])
    others = [k for k in est if k != "GRPO"]
    order = ["GRPO", *others]
    rows = [["base model", pct_ci(base["mean_over_levels"]), "", *(pct_ci(base["by_difficulty"][lv]) for lv in levels),
             "", ""]]  # fmt: skip
    for k in order:
        e = est[k]
        rows.append([label(k), pct_ci(e["mean_over_levels"]), f"{100 * e['change'][0]:+.1f} pts",
                     *(pct_ci(e["by_difficulty"][lv]) for lv in levels), pct(e["budget_l1"]["near_solved"][0]),
                     "(reference)" if k == "GRPO" else pts_ci(e["vs_grpo"])])  # fmt: skip
    head = ["estimator", "final accuracy, mean over levels", "change from base", *(f"sort-{lv}" for lv in levels),
            "L1 budget share of near-solved groups", "Δ vs GRPO (pts)"]  # fmt: skip
    top = max(others, key=lambda k: est[k]["vs_grpo"][0])
    assert all(abs(est[k]["vs_grpo"][0]) <= est[k]["vs_grpo"][1] for k in others), "a paired difference is significant"
    assert all(overlap(est[a]["mean_over_levels"], est[b]["mean_over_levels"]) for a in order for b in order)
    assert est[top]["vs_grpo"][0] > 0, "no estimator scored above GRPO"
    near = {k: est[k]["budget_l1"]["near_solved"] for k in order}
    by_near = sorted(order, key=lambda k: -near[k][0])
    assert all(not overlap(near[a], near[b]) for a in by_near[:2] for b in by_near[2:]), "the budget split is not clear"
    p4 = {k: est[k]["pass_at_k_vs_grpo"]["4"] for k in others}
    seeds, pairs = len(est["GRPO"]["seeds"]), len(others) * (len(levels) + 2)
    intro = (
        f"`{stamp['command']}` (published {stamp['date']}): the quickstart recipe with only the estimator and seed "
        f"changed, 200 steps, {seeds} seeds, mean ± 95 % CI over seeds; {rt['wall_minutes']} min of wall clock for the "
        f"{rt['runs']} runs, {rt['jobs']} at a time with one torch thread each, on {stamp['machine']['cpus']} cores "
        f"shared with other jobs (load average {stamp['machine']['load_average'][0]} at publication; {rt['minutes']} "
        "min of run time). Δ: the seed-paired difference of the final mean accuracy against GRPO."
    )
    lo, hi = (100 * (est[top]["vs_grpo"][0] + s * est[top]["vs_grpo"][1]) for s in (-1, 1))
    prose = (
        f"**No significant difference at this budget**: {label(top)} scored highest, "
        f"{100 * est[top]['vs_grpo'][0]:.1f} points above GRPO (paired 95 % CI [{lo:+.1f}, {hi:+.1f}]), and every "
        f"estimator's CI overlaps every other's; the base model alone scores "
        f"{spread([100 * x for x in base['mean_over_levels_range']], 1)} % over the seeds (validation noise). With "
        f"{seeds} seeds the ranking is within seed noise. What does separate clearly is where the gradient budget "
        "goes: " + ", ".join(f"{label(k)} {pct(near[k][0])}" for k in by_near) + " of the advantage mass on "
        "near-solved groups (L1 share). The paired pass@4 differences against GRPO ("
        + ", ".join(f"{label(k)} {pts_ci(p4[k])}" for k in sorted(others, key=lambda k: -p4[k][0]))
        + f" points; {len(p4)} of the report's {pairs} paired differences, uncorrected) are not claimed: with "
        f"{seeds} seeds they did not all hold when the benchmark was rerun on another machine of the same kind."
    )
    return wrap(intro) + "\n" + table(head, rows) + "\n\n" + wrap(prose)


#: departures from the pre-registered run of head_to_head_scalar.py (published in its result and report)
SCALAR_DEVIATIONS = [
    "The first start of the full run refused SoftmaxGRPO(temperature=0.16) at parse, before any training (two "
    "runs, seeds 0 and 1, exit 2): the default estimator in `configs/sort_tail_edit.yaml` carried the ESS rule's "
    "init arguments, which jsonargparse merged into the tau 0.16 override. The config was fixed in commit 404a917 "
    "(default estimator GRPO without init arguments) and the run resumed; the protocol is unchanged, and the "
    "GRPO, Dr.GRPO and ESS-rule runs had been built as specified.",
]


def deviations_section(result: dict) -> str:
    """The report's ``## Deviations`` section, from ``result["deviations"]``."""
    items = result.get("deviations") or ["None."]
    return "## Deviations\n\n" + "\n".join(f"- {item}" for item in items) + "\n"


def scalar_head_to_head(stamp: dict) -> str:
    r = stamp["result"]
    proto, pilot = r["protocol"], r["protocol"]["pilot"]
    alpha, per = proto["alpha"], r["primary"]["per_estimator"]
    prim = {row["estimator"]: row for row in r["primary"]["rows"]}
    mgf, edit = (
        {row["estimator"]: row for row in r["secondary"][k]["rows"]} for k in ("train/log_mgf", "train/reward")
    )
    values = {k: r["secondary"][k]["values"] for k in ("train/log_mgf", "train/reward")}
    pass8, budget = r["pass_primary_vs_grpo"], r["budget_l1"]
    order = list(per)
    order.remove("GRPO")
    fixed = next(k for k in order if k.startswith("SoftmaxGRPO(temperature=0"))
    ess = next(k for k in order if k.startswith("SoftmaxGRPO(temperature=None"))
    soft = [fixed, ess]
    rows = [["GRPO", pct_ci(per["GRPO"]["mean"]), "(reference)", "", values["train/log_mgf"]["GRPO"],
             values["train/reward"]["GRPO"], "(reference)"]]  # fmt: skip
    for k in order:
        p = prim[k]
        rows.append([label(k), pct_ci(per[k]["mean"]), interval(p["delta"], p["half_width"]),
                     bold(pval(p["p_holm"]), p["p_holm"] < alpha), values["train/log_mgf"][k],
                     values["train/reward"][k], pts_ci(pass8[k], 2)])  # fmt: skip
    tau = pilot["tau"]
    head = ["estimator", f"accuracy on levels {'-'.join(proto['primary_levels'][::2])}", "Δ vs GRPO (pts, 95 % CI)",
            "Holm p", f"log-MGF at tau {tau}", "edit similarity",
            f"pass@8 on levels {'-'.join(proto['primary_levels'][::2])}, Δ vs GRPO"]  # fmt: skip
    sig = [k for k in order if prim[k]["p_holm"] < alpha]
    assert sig == ["DrGRPO"] and prim["DrGRPO"]["delta"] < 0, "the primary result's narrative no longer holds"
    assert [k for k in order if mgf[k]["p_holm"] < alpha] == ["DrGRPO"] and mgf["DrGRPO"]["delta"] < 0
    assert all(edit[k]["delta"] < 0 for k in order) and not any(edit[k]["p_holm"] < alpha for k in order)
    near, both = (
        {k: budget[k]["near_solved"] for k in budget},
        {k: budget[k]["hard"][0] + budget[k]["unsolved"][0] for k in budget},
    )
    assert all(not overlap(near[s], near[g]) and near[s][0] < near[g][0] for s in soft for g in ("GRPO", "DrGRPO"))
    assert max(both.values()) - min(both.values()) < 0.1, "hard + unsolved no longer about equal for every estimator"
    up8 = [k for k in order if abs(pass8[k][0]) > pass8[k][1]]
    levels = ", ".join(proto["primary_levels"])
    intro = (
        f"`{stamp['command']}` (`--pilot` for the step-0 spread that fixed tau). The tail benchmark's setup with a "
        f"continuous reward: `{proto['config']}` scores a completion by its normalised Levenshtein similarity to the "
        "sorted digits (`EditSimilarity`, in [0, 1]); success, and so the primary metric, is still exact match. The "
        "paper's word F1 / ROUGE-L mix is not used: a sort answer is one word, so both word metrics are exact match, "
        "a binary reward. Roster: GRPO, Dr.GRPO, SoftmaxGRPO at a temperature fixed before the run, and SoftmaxGRPO "
        "with the per-group ESS rule (`temperature: null, temperature_rule: ess, target_ess: 0.5`: each group's tau "
        f"gives its softmax weights an effective sample size of half the group); {len(proto['seeds'])} seeds x "
        f"{proto['steps']} steps. The temperature rule, written down before the pilot: tau = the mean, over the "
        f"non-constant groups of a pilot of the step-0 policy ({pilot['groups']} groups, {pilot['constant_groups']} "
        f"constant), of the within-group std of the reward, two digits: {pilot['std_mean']}, so **tau = {tau}** (the "
        f"ESS rule picks a median tau of {pilot['ess_rule_tau_median']} on the same groups). The protocol, config and "
        "pilot numbers were committed before the run (`PROTOCOL` in `benchmarks/head_to_head_scalar.py`; one "
        "deviation in running it, none in the protocol: the report's Deviations). **Primary metric: final accuracy "
        f"on levels {levels}**, seed-paired against GRPO, two-sided paired t-tests with Holm's correction over the "
        f"{len(order)} comparisons; secondary: the plug-in log-MGF estimate `train/log_mgf` (tau log mean "
        f"exp(r / tau) at tau = {tau}, for every estimator) and the mean edit similarity, both over the last "
        f"{proto['secondary_window']} training steps. {r['runs_finished']} of {r['runs_planned']} runs finished "
        f"({r['run_time']['minutes_per_run']} min per run)."
    )
    e_f, e_s = edit[fixed], edit[ess]
    prose = (
        "**Result.** On a scalar reward, neither SoftmaxGRPO variant beats GRPO on the pre-registered primary metric: "
        f"the fixed tau is {100 * prim[fixed]['delta']:+.2f} points from GRPO (p {pval(prim[fixed]['p'])}) and the "
        f"ESS rule's {100 * prim[ess]['delta']:+.2f} points is not significant (unadjusted p {pval(prim[ess]['p'])}, "
        f"Holm {pval(prim[ess]['p_holm'])}). The one significant primary difference is Dr.GRPO, *below* GRPO at "
        f"{100 * prim['DrGRPO']['delta']:.2f} points (Holm p {pval(prim['DrGRPO']['p_holm'])}). On the log-MGF "
        f"estimate only Dr.GRPO differs from GRPO ({mgf['DrGRPO']['delta']:.4f}, Holm p "
        f"{pval(mgf['DrGRPO']['p_holm'])}). On mean edit similarity, the training reward, both SoftmaxGRPO variants "
        f"are *below* GRPO (tau {tau} {e_f['delta']:.4f}, ESS rule {e_s['delta']:.4f}; unadjusted p "
        f"{pval(e_f['p'])} and {pval(e_s['p'])}, Holm {pval(e_f['p_holm'])} and {pval(e_s['p_holm'])}), as is Dr.GRPO "
        f"({edit['DrGRPO']['delta']:.4f}, p {pval(edit['DrGRPO']['p'])}, Holm {pval(edit['DrGRPO']['p_holm'])}); no "
        "difference survives Holm. The SoftmaxGRPO variants move budget *away from near-solved groups* (L1 share of "
        f"the near-solved bucket {pct(near[fixed][0])} at tau {tau} and {pct(near[ess][0])} with the ESS rule against "
        f"{pct(near['GRPO'][0])} for GRPO), not to hard groups as a whole: the unsolved bucket (no exact match in the "
        f"group) carries {spread([100 * budget[k]['unsolved'][0] for k in budget], 1)} % of the mass, and hard plus "
        f"unsolved is {spread([100 * v for v in both.values()], 1)} % for every estimator; no gain in exact match "
        f"follows at this budget. Not pre-registered, so exploratory and uncorrected: pass@8 on levels {levels} "
        + words([f"{'rises' if pass8[k][0] > 0 else 'falls'} by {pts_ci(pass8[k], 2)} points under {label(k)}"
                 for k in up8]) + " (Holm not applied). The full report (per-level pass@1 / pass@8, budget shares, "
        "run time, deviations) is `benchmarks/reports/scalar_head_to_head/report.md`."
    )  # fmt: skip
    return wrap(intro) + "\n" + table(head, rows) + "\n\n" + wrap(prose)
