"""Tabular-softmax bandit: every estimator trains the same population of prompts with policy gradient.

Setup. ``--prompts-per-level`` prompts at each initial pass rate in ``--levels`` (default
0.05 / 0.2 / 0.5 / 0.8 / 0.95). Each prompt's policy is a softmax over ``--answers`` candidate
answers, one of them correct; the wrong answers' logits are drawn N(0, 0.5^2) per seed and the
correct one is set so the initial pass rate is exactly the level. Each step samples G answers per
prompt, scores them 1 (correct) or 0, turns the rewards into advantages with the estimator and
takes one SGD step on the logits along ``sum_i A_i grad log pi(a_i)`` (exact: A_i (onehot(a_i) - pi)).
The prompts share no parameters, so an estimator's allocation over difficulty acts as a per-prompt
step size: its expected update of prompt j is lr_e c_G(p_j) grad p_j (docs/objective.md §3.1).

Fairness. All estimators and seeds run in one vectorised loop (``[estimator, seed, prompt, ...]``)
with common random numbers: each seed has its own generator, and at every step every estimator
receives the *same* uniform draws (answers are sampled by inverse CDF), and the same initial logits.
Learning rates, ``--lr-norm``:

* ``objective`` (default): lr_e = lr / (F_G(1) / G), with F_G the estimator's exact objective
  (``population_objective``). Since F_G(1) = integral_0^1 c_G(p) dp, every estimator then has the same
  mean expected weight c_G(p)/G = 1 per rollout over p ~ U(0, 1) (RLOO's weight, everywhere), and they
  differ only in how they spread it over difficulty: each climbs its normalised objective F_G / F_G(1).
* ``l1``: lr_e = lr / m_e, with m_e the mean |A_i| per rollout under p ~ U(0, 1) (same expected L1
  gradient budget per step; from ``binary_group_advantages``).
* ``none``: the same lr for all (scale differences then act as learning-rate differences).

Under ``objective`` RLOO and Dr.GRPO follow identical trajectories (RLOO = G/(G-1) Dr.GRPO, and the
normalisation undoes the constant): a built-in sanity check of the common random numbers.

Metrics, per estimator, 95 % Student-t intervals over seeds: pass@1 (the mean of the exact p of the
tabular policy) and pass@k for k = G (1 - (1 - p)^G), overall and per initial difficulty, over steps;
and the gradient budget measured during training: ``budget_mass`` on the actual advantages, bucketed
by each group's empirical success rate K/G and summed over steps, with the near-solved/hard ratio.

Outputs in ``--out`` (default ``benchmarks/results/bandit/``): ``results.md``, ``pass_at_1.png``,
``by_difficulty.png`` and ``budget.png``; the tables are printed, with the wall time.

Threads: one by default. The tensors are tiny (8 x 5 x 100 x 10), so intra-op threads only add
synchronisation: on the project's loaded 2-core machine the default run took 1.4 s with one thread
and 20 s with two.

    python benchmarks/bandit.py [--steps 300] [--seeds 5] [--seed 0] [--lr 0.01] [--lr-norm objective] [--no-publish]

The tables and their figures (``result``: per estimator, mean and half-width of each cell) are published to
``benchmarks/reports/bandit/`` (``benchmarks/artefact.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks import artefact  # noqa: E402
from benchmarks._common import (  # noqa: E402
    SHOWN_BUCKETS,
    Entry,
    HelpFormatter,
    markdown_table,
    roster,
    save_figure,
    t_interval,
    use_agg_backend,
    write_markdown,
)
from estimators import BUCKETS, AdvantageEstimator, budget_mass  # noqa: E402

F64 = torch.float64
DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "bandit"
NEAR, HARD = BUCKETS.index("near_solved"), BUCKETS.index("hard")


@dataclass
class Run:
    """Everything recorded by one vectorised run; E estimators, S seeds, P prompts, T steps."""

    pass_rate: Tensor  # [T+1, E, S, P] exact p of each prompt's policy before each step (and at the end)
    mass: Tensor  # [E, S, 2, len(BUCKETS)] advantage mass (L1, L2) by bucket, summed over steps
    level: Tensor  # [P] index of each prompt's initial difficulty level
    lr: Tensor  # [E] learning rate of each estimator
    seconds: float


def lr_scale(est: AdvantageEstimator, group_size: int, norm: str) -> float:
    """Divisor of the base lr for ``--lr-norm`` (see the module docstring)."""
    if norm == "objective":
        return est.population_objective(1.0, group_size).item() / group_size
    if norm == "l1":
        return est.binary_group_advantages(group_size).abs().mean().item()  # G+1 groups: uniform K
    return 1.0


def initial_logits(levels: list[float], per_level: int, answers: int, gen: torch.Generator) -> Tensor:
    """``[P, answers]`` logits, correct answer first, with softmax(...)[:, 0] exactly the level."""
    p0 = torch.tensor(levels, dtype=F64).repeat_interleave(per_level)  # [P]
    wrong = 0.5 * torch.randn(len(p0), answers - 1, generator=gen, dtype=F64)  # [P, answers-1]
    correct = torch.logit(p0) + torch.logsumexp(wrong, -1)  # [P]
    return torch.cat([correct.unsqueeze(-1), wrong], -1)


def train(entries: list[Entry], args: argparse.Namespace) -> Run:
    start = time.perf_counter()
    e_count, s_count, g = len(entries), args.seeds, args.group_size
    gens = [torch.Generator().manual_seed(args.seed * 1_000_003 + s) for s in range(s_count)]
    init = torch.stack([initial_logits(args.levels, args.prompts_per_level, args.answers, gen) for gen in gens])
    p_count = init.shape[1]
    logits = init.unsqueeze(0).repeat(e_count, 1, 1, 1)  # [E, S, P, A]
    lr = torch.tensor([args.lr / lr_scale(e.estimator, g, args.lr_norm) for e in entries], dtype=F64)  # [E]
    pass_rate = torch.empty(args.steps + 1, e_count, s_count, p_count, dtype=F64)
    mass = torch.zeros(e_count, s_count, 2, len(BUCKETS), dtype=F64)
    for step in range(args.steps + 1):
        pi = torch.softmax(logits, -1)  # [E, S, P, A]
        pass_rate[step] = pi[..., 0]
        if step == args.steps:
            break
        # common random numbers: one [S, P, G] draw per step, shared by every estimator
        u = torch.stack([torch.rand(p_count, g, generator=gen, dtype=F64) for gen in gens])  # [S, P, G]
        answer = torch.searchsorted(pi.cumsum(-1), u.expand(e_count, -1, -1, -1).contiguous())
        answer.clamp_(max=args.answers - 1)  # [E, S, P, G]
        reward = (answer == 0).to(F64)  # [E, S, P, G]
        adv = torch.stack([e.estimator(reward[i].reshape(-1, g)) for i, e in enumerate(entries)])
        adv = adv.view(e_count, s_count, p_count, g)  # [E, S, P, G]
        success = reward.mean(-1)  # [E, S, P] empirical K/G
        for i in range(e_count):
            for s in range(s_count):
                mass[i, s] += budget_mass(adv[i, s], success[i, s])
        # grad_logits sum_i A_i log pi(a_i) = sum_i A_i (onehot(a_i) - pi)
        grad = torch.zeros_like(logits).scatter_add_(-1, answer, adv) - adv.sum(-1, keepdim=True) * pi
        logits += lr.view(-1, 1, 1, 1) * grad
    level = torch.arange(len(args.levels)).repeat_interleave(args.prompts_per_level)
    return Run(pass_rate, mass, level, lr, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- report
def pm(mean: Tensor, half: Tensor, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(float(mean))} ± {fmt.format(float(half))}"


def interval(samples: Tensor) -> list[float]:
    """``[mean, 95 % half-width]`` over seeds, as plain floats (the artefact's cells)."""
    return [float(v) for v in t_interval(samples)]


def key_figures(entries: list[Entry], run: Run, args: argparse.Namespace) -> dict:
    """The artefact's ``result``: per estimator, [mean, half-width] of final pass@1 and pass@G overall and
    per initial pass rate, and the pooled L1 / L2 near-solved/hard budget ratios."""
    final, g = run.pass_rate[-1], args.group_size  # [E, S, P]
    pooled = run.mass.sum(1)  # [E, 2, buckets]
    out = {"levels": list(args.levels), "steps": args.steps, "seeds": args.seeds, "group_size": g, "estimators": {}}
    for i, e in enumerate(entries):
        out["estimators"][e.label] = {
            "pass@1": interval(final[i].mean(-1)),
            f"pass@{g}": interval((1 - (1 - final[i]) ** g).mean(-1)),
            "pass@1_by_p0": {f"{p:g}": interval(final[i][:, run.level == j].mean(-1))
                             for j, p in enumerate(args.levels)},  # fmt: skip
            "near/hard": {"l1": float(pooled[i, 0, NEAR] / pooled[i, 0, HARD]),
                          "l2": float(pooled[i, 1, NEAR] / pooled[i, 1, HARD])},  # fmt: skip
        }
    return out


def tables(entries: list[Entry], run: Run, args: argparse.Namespace) -> list[str]:
    g, levels = args.group_size, args.levels
    final = run.pass_rate[-1]  # [E, S, P]
    pass1 = final.mean(-1)  # [E, S]
    passk = (1 - (1 - final) ** g).mean(-1)  # [E, S]
    auc = run.pass_rate.mean(-1).mean(0)  # [E, S] pass@1 averaged over steps
    auc_k = (1 - (1 - run.pass_rate) ** g).mean(-1).mean(0)  # [E, S] pass@G averaged over steps
    shares = run.mass / run.mass.sum(-1, keepdim=True)  # [E, S, 2, buckets]
    ratio = shares[..., NEAR] / shares[..., HARD]  # [E, S, 2]
    pooled = run.mass.sum(1)  # [E, 2, buckets]
    pooled_ratio = pooled[..., NEAR] / pooled[..., HARD]  # [E, 2]
    init = run.pass_rate[0, 0].mean(-1)  # [S]
    rows = []
    for i, e in enumerate(entries):
        rows.append([
            e.label,
            f"{run.lr[i].item():.4g}",
            pm(*t_interval(pass1[i])),
            pm(*t_interval(passk[i])),
            pm(*t_interval(auc[i])),
            pm(*t_interval(auc_k[i])),
            pm(*t_interval(ratio[i, :, 0])),
            pm(*t_interval(ratio[i, :, 1])),
        ])
    head = [
        "estimator", "lr", "final pass@1", f"final pass@{g}", "mean pass@1 over steps", f"mean pass@{g} over steps",
        "L1 near/hard (measured)", "L2 near/hard (measured)",
    ]
    summary = (
        f"## Summary after {args.steps} steps (mean ± 95% t-interval over {args.seeds} seeds; initial pass@1 "
        f"{init.mean().item():.3f}; G = {g}, {len(run.level)} prompts, {args.answers} answers, "
        f"lr-norm `{args.lr_norm}`, base lr {args.lr:g})\n\n" + markdown_table(head, rows)
    )
    by_level = []
    for i, e in enumerate(entries):
        cells = [pm(*t_interval(final[i][:, run.level == j].mean(-1))) for j in range(len(levels))]
        by_level.append([e.label, *cells])
    difficulty = (
        "## Final pass@1 by initial pass rate (mean ± 95% t-interval over seeds)\n\n"
        + markdown_table(["estimator", *(f"p0={p:g}" for p in levels)], by_level)
    )
    cols = [BUCKETS.index(b) for b in SHOWN_BUCKETS]
    budget_rows = [
        [e.label, *(f"{pooled[i, 0, c].item() / pooled[i, 0].sum().item():.1%}" for c in cols),
         f"{pooled_ratio[i, 0].item():.3f}", f"{pooled_ratio[i, 1].item():.3f}"]
        for i, e in enumerate(entries)
    ]
    budget = (
        "## Measured L1 budget share by empirical K/G bucket (pooled over steps and seeds)\n\n"
        + markdown_table(["estimator", *SHOWN_BUCKETS, "L1 near/hard", "L2 near/hard"], budget_rows)
    )
    return [summary, difficulty, budget]


def plot_curves(ax, entries: list[Entry], series: Tensor, ylabel: str, title: str) -> None:
    """``series`` ``[T+1, E, S]``: mean over seeds with a 95 % t band."""
    steps = torch.arange(series.shape[0])
    for i, e in enumerate(entries):
        mean, half = t_interval(series[:, i], dim=1)
        ax.plot(steps, mean, **e.line, lw=1.6)
        ax.fill_between(steps, mean - half, mean + half, color=e.color, alpha=0.15, lw=0)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)


def plot_all(entries: list[Entry], run: Run, args: argparse.Namespace, out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    g = args.group_size
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    plot_curves(axes[0], entries, run.pass_rate.mean(-1), "pass@1 (mean over prompts)", "pass@1")
    plot_curves(axes[1], entries, (1 - (1 - run.pass_rate) ** g).mean(-1), f"pass@{g}", f"pass@{g} (k = G)")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.suptitle(f"Tabular bandit, {args.seeds} seeds, 95% t-bands, lr-norm '{args.lr_norm}'", y=1.02)
    fig.tight_layout()
    paths = [save_figure(fig, out / "pass_at_1.png")]

    levels = args.levels
    fig, axes = plt.subplots(2, len(levels), figsize=(3.6 * len(levels), 7.6))
    for j, p0 in enumerate(levels):
        p = run.pass_rate[..., run.level == j]  # [T+1, E, S, prompts of level j]
        plot_curves(axes[0, j], entries, p.mean(-1), "", f"initial p = {p0:g}")
        plot_curves(axes[1, j], entries, ((1 - p) ** g).mean(-1), "", "")  # 1 - pass@G, no cancellation
        axes[1, j].set_yscale("log")
    axes[0, 0].set_ylabel("pass@1 (mean over the level's prompts)")
    axes[1, 0].set_ylabel(f"1 - pass@{g}  (log)")
    axes[0, -1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.tight_layout()
    paths.append(save_figure(fig, out / "by_difficulty.png"))

    colors = plt.get_cmap("RdYlGn")([0.05, 0.3, 0.5, 0.7, 0.95])
    pooled = run.mass.sum(1)  # [E, 2, buckets]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2), sharey=True)
    labels = [e.label for e in entries][::-1]
    for row, (ax, norm) in enumerate(zip(axes, ("L1", "L2"))):
        share = pooled[:, row] / pooled[:, row].sum(-1, keepdim=True)  # [E, buckets]
        left = torch.zeros(len(entries), dtype=F64)
        for b, bucket in enumerate(SHOWN_BUCKETS):
            width = share.flip(0)[:, BUCKETS.index(bucket)]
            ax.barh(labels, width, left=left, color=colors[b], edgecolor="white", label=bucket)
            for y, (x0, w) in enumerate(zip(left.tolist(), width.tolist())):
                if w > 0.06:
                    ax.text(x0 + w / 2, y, f"{w:.0%}", ha="center", va="center", fontsize=7.5)
            left += width
        near_hard = (share[:, NEAR] / share[:, HARD]).flip(0)
        for y, r in enumerate(near_hard.tolist()):
            ax.text(1.01, y, f"{r:.3f}", va="center", fontsize=8)
        ax.set_xlim(0, 1)
        ax.set(title=f"{norm} budget share measured in training   (right: near/hard)",
               xlabel="share of sum over steps, bucketed by the group's K/G")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.1, 1), title="bucket (K/G)", fontsize=9)
    fig.tight_layout()
    paths.append(save_figure(fig, out / "budget.png"))
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="policy-gradient steps")
    parser.add_argument("--seeds", type=int, default=5, help="independent seeds (confidence intervals over these)")
    parser.add_argument("--seed", type=int, default=0, help="base seed; seed s uses its own generator")
    parser.add_argument("--group-size", type=int, default=8, help="G, answers sampled per prompt and step")
    parser.add_argument("--answers", type=int, default=10, help="candidate answers per prompt (one correct)")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.2, 0.5, 0.8, 0.95], help="initial p")
    parser.add_argument("--prompts-per-level", type=int, default=20, help="prompts at each level")
    parser.add_argument("--lr", type=float, default=0.01, help="base SGD learning rate on the logits")
    parser.add_argument("--lr-norm", choices=("objective", "l1", "none"), default="objective", help="see above")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the tensors are tiny)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    return artefact.publish_option(parser).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    entries = roster()
    run = train(entries, args)
    sections = tables(entries, run, args)
    print("\n\n".join(sections))
    title = "Tabular bandit: estimators head to head"
    written = [write_markdown(args.out / "results.md", title, sections)]
    if not args.no_plots:
        use_agg_backend()
        written += plot_all(entries, run, args, args.out)
    timing = (f"{len(entries)} estimators x {args.seeds} seeds x {args.steps} steps: training {run.seconds:.1f} s, "
              f"total {time.perf_counter() - start:.1f} s wall")  # fmt: skip
    report = f"# {title}\n\n" + "\n\n".join([*sections, timing])
    written.append(artefact.publish_run(args, "bandit", key_figures(entries, run, args), report, __file__, argv))
    print(f"\n{timing}; wrote {', '.join(str(p) for p in written if p)}")


if __name__ == "__main__":
    main()
