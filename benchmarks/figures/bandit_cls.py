"""Renders of the bandit and classification artefacts (bandit, classification, classification_lr)."""

from __future__ import annotations

from benchmarks.figures._fmt import bold, num, spread, table, words, wrap


def _bandit_label(name: str) -> str:
    return name.replace("Softmax tau=", "SoftmaxGRPO tau ")


def _tau(label: str) -> str:
    return label.replace("SoftmaxGRPO ", "")


def bandit(stamp: dict) -> str:
    r = stamp["result"]
    est, levels = dict(r["estimators"]), r["levels"]
    lv = [str(x) for x in levels]
    order = ["GRPO", "Dr.GRPO", "RLOO", "MaxRL", *sorted((k for k in est if k.startswith("Softmax")),
                                                        key=lambda k: float(k.split("=")[1]))]  # fmt: skip
    rows = [[_bandit_label(k), f"{est[k]['pass@1'][0]:.3f} ± {est[k]['pass@1'][1]:.3f}",
             *(f"{est[k]['pass@1_by_p0'][p][0]:.3f} ± {est[k]['pass@1_by_p0'][p][1]:.3f}" for p in lv),
             f"{est[k]['near/hard']['l1']:.3f}", f"{est[k]['near/hard']['l2']:.3f}"] for k in order]  # fmt: skip
    assert rows[1][1:] == rows[2][1:], "Dr.GRPO and RLOO no longer coincide: give RLOO its own row"
    rows[1:3] = [["Dr.GRPO / RLOO", *rows[1][1:]]]
    est["Dr.GRPO / RLOO"] = est.pop("Dr.GRPO")
    order.remove("Dr.GRPO")
    order.remove("RLOO")
    head = ["estimator", "final pass@1", *(f"p0 = {p}" for p in lv), "L1 near/hard", "L2 near/hard"]

    def at(k, p):
        return est[k]["pass@1_by_p0"][p][0]

    movers = [k for k in order if k == "MaxRL" or k.startswith("Softmax")]
    hard, rest = lv[0], lv[1:]
    assert all(at(k, hard) > at("GRPO", hard) for k in movers), "not every mover beats GRPO on the hardest prompts"
    assert all(at("GRPO", p) == max(at(k, p) for k in order) for p in rest), "GRPO is not best at every other p0"
    by_budget = sorted(movers, key=lambda k: -est[k]["near/hard"]["l1"])  # least budget moved first
    ordered = [p for p in rest if [at(k, p) for k in by_budget] == sorted((at(k, p) for k in by_budget), reverse=True)]
    assert rest[0] in ordered, f"at p0 = {rest[0]} the movers no longer rank by the budget they move"

    def listing(p, keys):
        return ", ".join(f"{_tau(_bandit_label(k))} {at(k, p):.3f}" for k in keys)

    def overall(keys):
        return ", ".join(f"{est[k]['pass@1'][0]:.3f}" for k in keys)

    above = [k for k in movers if est[k]["pass@1"][0] > est["GRPO"]["pass@1"][0]]
    below = [k for k in movers if k not in above]
    l1 = sorted(order, key=lambda k: -est[k]["near/hard"]["l1"])
    temps = [k for k in l1 if k.startswith("Softmax")]
    assert [float(k.split("=")[1]) for k in temps] == sorted((float(k.split("=")[1]) for k in temps), reverse=True)
    assert l1[0] == "GRPO" and l1[-1] == "MaxRL", "GRPO and MaxRL no longer bound the L1 near/hard ratios"
    ranked = sorted(movers, key=lambda k: -at(k, hard))
    prose = (
        f"What this shows is a trade, not a uniform gain. On the hardest prompts (p0 = {hard}) every SoftmaxGRPO "
        f"temperature and MaxRL beat GRPO ({listing(hard, ranked)}, against {at('GRPO', hard):.3f}; Dr.GRPO / RLOO "
        f"{at('Dr.GRPO / RLOO', hard):.3f}). On every other column (p0 >= {rest[0]}) GRPO is the best estimator and "
        f"every SoftmaxGRPO temperature and MaxRL are below it, the more so the more budget they move (at p0 = "
        f"{rest[0]}: {listing(rest[0], by_budget)}, against GRPO {at('GRPO', rest[0]):.3f}"
        + ("" if ordered == rest else f"; that order holds at p0 = {words(ordered)} only")
        + f"). Overall, {words([_tau(_bandit_label(k)) for k in above])} end above GRPO "
        f"({overall(above)} against {est['GRPO']['pass@1'][0]:.3f}), "
        f"{words([_tau(_bandit_label(k)) for k in below])} below it "
        f"({overall(below)}). The measured budget ratios order as the "
        f"temperatures do: L1 near/hard from {est['GRPO']['near/hard']['l1']:.3f} (GRPO) down through "
        f"{words([_tau(_bandit_label(k)).removeprefix('tau ') for k in temps])} to "
        f"{est['MaxRL']['near/hard']['l1']:.3f} (MaxRL)."
    )
    intro = (
        f"The tabular bandit, `{stamp['command']}` (published {stamp['date']}): 100 prompts at {len(lv)} initial "
        f"pass rates p0, 10 candidate answers, G = {r['group_size']}, {r['steps']} steps, {r['seeds']} seeds, "
        "learning rates normalised so every estimator has the same mean weight over p ~ U(0, 1). Final pass@1 "
        "overall and by initial pass rate (mean ± 95 % CI over seeds), and the gradient budget on near-solved "
        "over hard groups measured during training (pooled over steps and seeds):"
    )
    return wrap(intro) + "\n" + table(head, rows) + "\n\n" + wrap(prose)


def _cls_label(name: str) -> str:
    return name.replace("tau=", "tau ")


def classification(stamp: dict) -> str:
    r = stamp["result"]
    a, est, init = r["args"], r["summary"]["estimators"], r["summary"]["initial"]
    others = [k for k in est if k != "GRPO"]

    def delta(k, metric):
        m = est[k][metric]
        return bold(f"{m['diff']:+.2f} ± {m['diff_half']:.2f}", abs(m["diff"]) > m["diff_half"])

    rows = [["initial (uniform policy)", f"{init['top-1']:.2f} %", "", f"{init['pass@1']:.2f} %", "",
             f"{init['pass@5']:.2f} %", f"{init['pass@256']:.2f} %", ""]]  # fmt: skip
    for k in [
        "GRPO",
        *sorted(
            others, key=lambda k: ("Dr.GRPO", "RLOO", "MaxRL").index(k) if k in ("Dr.GRPO", "RLOO", "MaxRL") else 9
        ),
    ]:
        e = est[k]
        rows.append([_cls_label(k), f"{e['top-1']['mean']:.2f} % ± {e['top-1']['half']:.2f}",
                     "(reference)" if k == "GRPO" else delta(k, "top-1"),
                     f"{e['pass@1']['mean']:.2f} % ± {e['pass@1']['half']:.2f}",
                     "(reference)" if k == "GRPO" else delta(k, "pass@1"), f"{e['pass@5']['mean']:.2f} %",
                     f"{e['pass@256']['mean']:.2f} %", f"{e['top-1 hard third']:.2f} %"])  # fmt: skip
    head = ["estimator", "top-1", "Δ top-1 vs GRPO (pts)", "pass@1", "Δ pass@1 (pts)", "pass@5", "pass@256",
            "top-1, hardest third of classes"]  # fmt: skip
    tight = max(est[k][m]["diff_half"] for k in others for m in ("top-1", "pass@1", "pass@5"))
    wide = [est[k]["pass@256"]["diff_half"] for k in others]
    seeds = [est[k]["pass@256"]["seeds_for_1pt"] for k in others]
    assert tight < 1 <= min(wide), "the power paragraph's split (top-1/pass@1/pass@5 within 1 point) no longer holds"
    soft = next(k for k in others if k.startswith("SoftmaxGRPO"))
    top = {k: est[k]["top-1"]["mean"] for k in est}
    low = ["GRPO", "Dr.GRPO", "RLOO"]
    assert top["MaxRL"] > top[soft] > max(top[k] for k in low), "MaxRL > SoftmaxGRPO > the rest no longer holds"
    assert top[soft] - max(top[k] for k in low) > top["MaxRL"] - top[soft], "SoftmaxGRPO is no closer to MaxRL"
    p1 = {k: f"{est[k]['pass@1']['mean']:.2f}" for k in ("Dr.GRPO", "RLOO")}
    assert p1["Dr.GRPO"] == p1["RLOO"], "Dr.GRPO and RLOO no longer agree on pass@1"
    hard = {k: est[k]["top-1 hard third"] for k in est}
    assert min(hard["MaxRL"], hard[soft]) > hard["GRPO"]
    setup = (
        f"Setup (`{stamp['command']}`): an analogue of the paper's ResNet-50/ImageNet experiment "
        f"at CPU scale, not that experiment: {num(a['classes'], 0)} synthetic classes (Gaussian prototypes in d = "
        f"{a['dim']}, per-class noise with spread {a['spread']}, so some classes are much harder than others), a "
        f"{a['dim']}-{a['hidden']}-{num(a['classes'], 0)} ReLU network (an MLP) that starts from the uniform policy "
        f"and is trained only from rewards: per input G = {a['group_size']} labels sampled from the policy, reward 1 "
        "for the true class, the estimator's advantages (`estimators.GRPO`, `DrGRPO`, `RLOO`, `MaxRL`, "
        f"`SoftmaxGRPO({a['tau']})`, as in LM training), one SGD step on the mean over rollouts; {a['steps']} steps x "
        f"{a['batch']} fresh inputs, learning rates normalised by the objective as in the bandit, common random "
        f"numbers, {a['seeds']} seeds (a new problem each), a test set of {a['test_per_class']} inputs per class. "
        "Metrics: top-1 (argmax), exact pass@1 (the policy's probability of the true class) and exact pass@k = 1 - "
        f"(1 - p)^k. Wall time {r['seconds']:.0f} s at load average {r['load_at_start'][0]} on "
        f"{stamp['machine']['cpus']} cores."
    )
    prose = (
        f"**Power**: every paired half-width on top-1, pass@1 and pass@5 is within 1 point (largest {tight:.2f}); "
        f"pass@256 is not ({spread(wide)}; {spread(seeds, 0)} seeds would be needed).\n\n"
        f"**Result.** Learning from a uniform start over {num(a['classes'], 0)} classes is a hard-prompt problem: "
        f"every input begins at p = {init['pass@1']:.2f} %, so a success is rare and the estimators that weight rare "
        f"successes heavily win by a wide margin. MaxRL reaches {top['MaxRL']:.2f} % top-1 and {_cls_label(soft)} "
        f"{top[soft]:.2f} %, while {words(low)} stay at {spread([top[k] for k in low])} % after {a['steps']} steps "
        f"(Dr.GRPO and RLOO, identical up to the normalised constant, keep an almost uniform policy: pass@1 "
        f"{p1['RLOO']} %; their small differences are rounding, the two take the same steps in exact arithmetic). "
        f"{_cls_label(soft)} lands between MaxRL and GRPO, closer to MaxRL, but not above it. The gain holds on the "
        f"hardest third of the classes too ({hard['MaxRL']:.2f} % and {hard[soft]:.2f} % against "
        f"{hard['GRPO']:.2f} % for GRPO)."
    )
    return wrap(setup) + "\n" + table(head, rows) + "\n\n" + wrap(prose)


def rate(lr: float) -> str:
    """A learning rate as the grid names it: 0.5, 16 (not 0 or 16.0)."""
    return f"{lr:g}"


def classification_lr(stamp: dict) -> str:
    r = stamp["result"]
    lrs, by_lr = r["lrs"], r["by_lr"]
    names = list(by_lr[str(lrs[0])]["estimators"])

    def top1(k, lr):
        return by_lr[str(lr)]["estimators"][k]["top-1"]["mean"]

    best = {k: max(lrs, key=lambda lr, k=k: top1(k, lr)) for k in names}
    assert all(best[k] == r["best"][k]["lr"] for k in names), "result.json's best rates differ from its by_lr"

    def edge(lr):
        if lr == min(lrs):
            return ", the lowest rate tried, so the optimum may lie lower"
        return ", the highest rate tried, so the optimum may lie higher" if lr == max(lrs) else ""

    groups: dict[tuple, list[str]] = {}
    for k in names:  # estimators with the same best rate and figure (Dr.GRPO and RLOO) share a clause
        groups.setdefault((best[k], f"{top1(k, best[k]):.2f}"), []).append(_cls_label(k))
    clauses = [f"{rate(lr)} for {words(ks)} ({fig} % top-1{edge(lr)})" for (lr, fig), ks in groups.items()]
    vs = {k: r["best"][k] for k in names if k != "GRPO"}
    order = sorted(names, key=lambda k: -top1(k, best[k]))
    shared = [lr for lr in lrs if sorted(names, key=lambda k, lr=lr: -top1(k, lr))[:2] == order[:2]]
    largest = max(names, key=lambda k: best[k])
    ceiling = max(top1(k, max(lrs)) for k in names)
    assert all(top1(k, max(lrs)) < top1(k, best[k]) for k in names if best[k] != max(lrs))
    diffs: dict[str, list[str]] = {}
    for k, b in vs.items():
        diffs.setdefault(f"{b['diff']:+.2f} ± {b['diff_half']:.2f}", []).append(_cls_label(k))
    seeds = f"{r['seeds']} seeds per rate and " if "seeds" in r else ""
    return wrap(
        f"`{stamp['command']}`: with {seeds}base rates {', '.join(rate(lr) for lr in lrs)}, each estimator's "
        f"best rate (highest mean top-1) is " + "; ".join(clauses) + ". Each at its own best rate, against GRPO at "
        "its best: " + ", ".join(f"{words(ks)} {d}" for d, ks in diffs.items()) + " top-1 points. Ranked at their "
        f"best rates: {', '.join(_cls_label(k) for k in order)}; the same two lead, in that order, at base rate"
        f"{'s' if len(shared) > 1 else ''} {words([rate(lr) for lr in shared]) if shared else 'none'} of the "
        f"grid. {_cls_label(largest)} has the largest best rate ({rate(best[largest])}). At {rate(max(lrs))} "
        f"every estimator scores at most {ceiling:.2f} % top-1"
        + (", below its best." if all(best[k] != max(lrs) for k in names) else ".")
    )
