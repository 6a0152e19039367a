"""Population theory, head to head: c_G(p), F_G(p), large-group weights and gradient budget by difficulty.

Every number comes from the library's own exact theory (docs/objective.md §3-§5, docs/gradient_budget.md §6),
never from a re-derived closed form:

* ``c_G(p)`` and ``F_G(p)``: ``AdvantageEstimator.population_weight`` / ``population_objective``;
* the large-group per-rollout weight ``lim c_G/G``: ``SoftmaxGRPO.large_group_weight`` where the
  estimator has one, otherwise Richardson extrapolation in 1/G of the exact ``c_G(p)/G`` at
  G = 256, 512, 1024 (c_G/G = w(p) + a(p)/G + b(p)/G^2 + ..., accurate to ~1e-5 for p in [0.05, 0.95]);
* budgets: ``binary_group_advantages`` (the G+1 binary groups) fed to ``budget_mass`` /
  ``budget_shares``; under the prior p ~ U(0, 1) every K has P(K) = 1/(G+1), so the expected shares
  are the shares of the G+1 groups taken once each. The expected budget of a prompt with pass rate
  p weights the per-K budgets by the binomial law of K.

Outputs (default ``benchmarks/results/population/``): ``tables.md`` and the figures
``weights.png`` (per-rollout c_G/G), ``objectives.png`` (F_G), ``large_group.png``,
``budget_shares.png`` and ``expected_budget.png``. The tables are also printed.
``tests/test_benchmarks_population.py`` checks these tables against independently computed reference numbers.

    python benchmarks/population.py [--out DIR] [--no-plots] [--no-publish]

The tables are published to ``benchmarks/reports/population/`` (``benchmarks/artefact.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
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
    ratio,
    roster,
    save_figure,
    softmax_color,
    use_agg_backend,
    write_markdown,
)
from estimators import BUCKETS, GRPO, RLOO, AdvantageEstimator, DrGRPO, MaxRL, SoftmaxGRPO, budget_mass  # noqa: E402
from estimators.base import binomial_pmf  # noqa: E402

F64 = torch.float64
P_TABLE = (0.05, 0.25, 0.5, 0.75, 0.95)
GROUP_SIZES = (4, 8, 16, 64)
RICHARDSON_SIZES = (256, 512, 1024)
DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "population"


def table_entries() -> list[Entry]:
    """The rows of the c_G table (both GRPO stds, all MaxRL variants, tau up to 4)."""
    return [
        Entry("GRPO (pop std)", GRPO(std="population"), "#d62728"),
        Entry("GRPO (sample std)", GRPO(), "#d62728"),
        Entry("Dr.GRPO", DrGRPO(), "#ff7f0e"),
        Entry("RLOO", RLOO(), "#8c564b"),
        Entry("MaxRL practical", MaxRL(), "#000000"),
        Entry("MaxRL cv_unbiased", MaxRL(variant="cv_unbiased"), "#000000"),
        Entry("MaxRL nocv", MaxRL(variant="nocv"), "#000000"),
        *(
            Entry(f"Softmax tau={tau:g}", SoftmaxGRPO(temperature=tau), softmax_color(tau))
            for tau in (0.25, 0.5, 1.0, 2.0, 4.0)
        ),
    ]


# ---------------------------------------------------------------------------------------------- theory
def weights(entries: list[Entry], group_size: int, ps=P_TABLE) -> dict[str, list[float]]:
    """c_G at ``ps`` then c(0+) and c(1-) (the exact values at p = 0 and p = 1), per label."""
    p = torch.tensor([*ps, 0.0, 1.0], dtype=F64)
    return {e.label: e.estimator.population_weight(p, group_size).tolist() for e in entries}


def large_group_weight(est: AdvantageEstimator, p: Tensor) -> Tensor:
    """lim_{G->inf} c_G(p)/G: the estimator's own closed form if it has one, else Richardson in 1/G."""
    closed_form = getattr(est, "large_group_weight", None)
    if closed_form is not None:
        return closed_form(p)
    return richardson_limit(est, p)


def richardson_limit(est: AdvantageEstimator, p: Tensor) -> Tensor:
    """Two Richardson steps on c_G(p)/G at G = 256, 512, 1024 (removes the 1/G and 1/G^2 terms)."""
    w = [est.population_weight(p, g) / g for g in RICHARDSON_SIZES]
    first = [2 * w[i + 1] - w[i] for i in range(2)]
    return (4 * first[1] - first[0]) / 3


def large_group_weights(entries: list[Entry], ps=P_TABLE) -> dict[str, list[float]]:
    p = torch.tensor(ps, dtype=F64)
    return {e.label: large_group_weight(e.estimator, p).tolist() for e in entries}


def binary_budgets(est: AdvantageEstimator, group_size: int) -> tuple[Tensor, Tensor]:
    """Per-K budgets of the G+1 binary groups: (L1 = sum|A|, L2 = sum A^2), each float64 ``[G+1]``."""
    adv = est.binary_group_advantages(group_size)  # [G+1, G], row K has K successes
    return adv.abs().sum(-1), adv.square().sum(-1)


def uniform_prior_shares(est: AdvantageEstimator, group_size: int) -> Tensor:
    """Expected budget shares under p ~ U(0,1) (P(K) = 1/(G+1)): ``[2, len(BUCKETS)]``, rows L1, L2."""
    adv = est.binary_group_advantages(group_size)  # [G+1, G]
    rate = torch.arange(group_size + 1, dtype=F64) / group_size  # [G+1]
    mass = budget_mass(adv, rate)  # each K once: equal prior weights
    return mass / mass.sum(-1, keepdim=True)


def share_rows(entries: list[Entry], group_size: int) -> dict[str, dict[str, list[float]]]:
    """{"l1"|"l2": {label: [shares of SHOWN_BUCKETS..., near/hard]}} as fractions."""
    cols = [BUCKETS.index(b) for b in SHOWN_BUCKETS]
    out: dict[str, dict[str, list[float]]] = {"l1": {}, "l2": {}}
    for e in entries:
        shares = uniform_prior_shares(e.estimator, group_size)
        for row, norm in enumerate(("l1", "l2")):
            s = shares[row, cols].tolist()
            out[norm][e.label] = [*s, ratio(s[-1], s[0])]
    return out


def per_k_l1(entries: list[Entry], group_size: int) -> dict[str, list[float]]:
    """L1 budget sum_i |A_i| of the group with K = 1..G-1 successes."""
    return {e.label: binary_budgets(e.estimator, group_size)[0][1:-1].tolist() for e in entries}


def expected_l1(entries: list[Entry], group_size: int, ps=P_TABLE) -> dict[str, list[float]]:
    """E_{K~Bin(G,p)}[sum_i |A_i|] at ``ps``, then the ratio of the last to the first (p=.95 : p=.05)."""
    pmf = binomial_pmf(torch.tensor(ps, dtype=F64), group_size)  # [len(ps), G+1]
    out = {}
    for e in entries:
        values = (pmf @ binary_budgets(e.estimator, group_size)[0]).tolist()
        out[e.label] = [*values, ratio(values[-1], values[0])]
    return out


# ---------------------------------------------------------------------------------------------- tables
def _fmt_rows(table: dict[str, list[float]], fmts: list[str]) -> list[list[str]]:
    return [[label, *(f.format(v) for f, v in zip(fmts, values))] for label, values in table.items()]


def tables() -> list[str]:
    """Every markdown table of the report, each with a heading line."""
    sections = []
    ps_head = [f"p={p:g}" for p in P_TABLE]
    c8 = weights(table_entries(), 8)
    sections.append(
        "## c_G(p) for G = 8 (docs/reference_numbers.md §8.1; exact `population_weight`, "
        "c(0+) / c(1-) at p = 0 / 1)\n\n"
        + markdown_table(["estimator", *ps_head, "c(0+)", "c(1-)"], _fmt_rows(c8, ["{:.4f}"] * 5 + ["{:.3f}"] * 2))
    )
    for g in GROUP_SIZES:
        per_rollout = {k: [v / g for v in vs] for k, vs in weights(roster(), g).items()}
        sections.append(
            f"## Per-rollout weight c_G(p)/G, G = {g}\n\n"
            + markdown_table(
                ["estimator", *ps_head, "c(0+)/G", "c(1-)/G"], _fmt_rows(per_rollout, ["{:.4f}"] * 7)
            )
        )
    big = roster()
    limits = large_group_weights(big)
    sections.append(
        "## Large-G per-rollout weight lim c_G/G (docs/objective.md §4; SoftmaxGRPO.large_group_weight, "
        "else Richardson "
        f"on exact c_G/G at G = {', '.join(map(str, RICHARDSON_SIZES))})\n\n"
        + markdown_table(["estimator", *ps_head], _fmt_rows(limits, ["{:.4f}"] * 5))
    )
    objective = {
        e.label: (e.estimator.population_objective(torch.tensor(P_TABLE + (1.0,), dtype=F64), 8) / 8).tolist()
        for e in big
    }
    sections.append(
        "## Per-rollout objective F_G(p)/G, G = 8 (exact `population_objective`; F_G(0) = 0)\n\n"
        + markdown_table(["estimator", *ps_head, "p=1"], _fmt_rows(objective, ["{:.4f}"] * 6))
    )
    head = ["estimator", *SHOWN_BUCKETS, "near/hard"]
    pct = ["{:.1%}"] * 5 + ["{:.3f}"]
    for g in (8, 16):
        shares = share_rows(big, g)
        for norm in ("l1", "l2"):
            sections.append(
                f"## {norm.upper()} budget share by bucket, G = {g}, p ~ U(0,1) (docs/gradient_budget.md §6)\n\n"
                + markdown_table(head, _fmt_rows(shares[norm], pct))
            )
    sections.append(
        "## Per-K L1 budget sum_i |A_i|, G = 8, K = 1..7 (docs/gradient_budget.md §6)\n\n"
        + markdown_table(["estimator", *(f"K={k}" for k in range(1, 8))], _fmt_rows(per_k_l1(big, 8), ["{:.3f}"] * 7))
    )
    sections.append(
        "## Expected L1 budget of a prompt with pass rate p, G = 8 (docs/gradient_budget.md §6)\n\n"
        + markdown_table(["estimator", *ps_head, "p=.95 : p=.05"], _fmt_rows(expected_l1(big, 8), ["{:.3f}"] * 6))
    )
    return sections


def key_figures() -> dict:
    """The artefact's ``result``: c_G(p) at G = 8 (then c(0+), c(1-)) and the L1 / L2 budget shares of
    ``SHOWN_BUCKETS`` (then near/hard) under p ~ U(0, 1) at G = 8 and 16, per estimator."""
    return {"p": list(P_TABLE), "c_G8": weights(table_entries(), 8),
            "budget_shares": {f"G{g}": share_rows(roster(), g) for g in (8, 16)}}  # fmt: skip


# ---------------------------------------------------------------------------------------------- figures
def plot_weights(out: Path) -> Path:
    import matplotlib.pyplot as plt

    p = torch.linspace(0, 1, 401, dtype=F64)
    fig, axes = plt.subplots(1, len(GROUP_SIZES), figsize=(4.2 * len(GROUP_SIZES), 4.2), sharey=True)
    for ax, g in zip(axes, GROUP_SIZES):
        for e in roster():
            ax.plot(p, e.estimator.population_weight(p, g) / g, **e.line, lw=1.8)
        ax.set_yscale("log")
        ax.set_title(f"G = {g}")
        ax.set_xlabel("pass rate p")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("per-rollout weight c_G(p) / G  (log)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.suptitle("Expected weight of grad p per rollout: E[sum_i A_i s_i] = c_G(p) grad p", y=1.02)
    return save_figure(fig, out / "weights.png")


def plot_objectives(out: Path) -> Path:
    import matplotlib.pyplot as plt

    p = torch.linspace(0, 1, 201, dtype=F64)
    fig, axes = plt.subplots(2, len(GROUP_SIZES), figsize=(4.2 * len(GROUP_SIZES), 7.6))
    for col, g in enumerate(GROUP_SIZES):
        for e in roster():
            f = e.estimator.population_objective(p, g)
            axes[0, col].plot(p, f / g, **e.line, lw=1.8)
            axes[1, col].plot(p, f / f[-1], **e.line, lw=1.8)
        axes[0, col].set_title(f"G = {g}")
        for ax in axes[:, col]:
            ax.set_xlabel("pass rate p")
            ax.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel("F_G(p) / G")
    axes[1, 0].set_ylabel("F_G(p) / F_G(1)")
    axes[0, -1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.suptitle("Exact finite-group objective F_G(p) (F_G' = c_G): per rollout, and normalised", y=1.0)
    fig.tight_layout()
    return save_figure(fig, out / "objectives.png")


def plot_large_group(out: Path) -> Path:
    import matplotlib.pyplot as plt

    p = torch.linspace(0.03, 0.97, 189, dtype=F64)
    sizes = [2**k for k in range(2, 11)]
    ends = torch.tensor([0.0, 1.0], dtype=F64)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for e in roster():
        axes[0].plot(p, large_group_weight(e.estimator, p), **e.line, lw=1.8)
        c = torch.stack([e.estimator.population_weight(ends, g) / g for g in sizes])  # [len(sizes), 2]
        axes[1].plot(sizes, c[:, 0], marker="o", **e.line, ms=3)
        axes[2].plot(sizes, c[:, 1], marker="o", **e.line, ms=3)
    axes[0].set(yscale="log", xlabel="pass rate p", ylabel="lim c_G(p)/G  (log)", title="Large-group weight")
    axes[1].set(xscale="log", yscale="log", xlabel="group size G", ylabel="c(0+)/G  (log)",
                title="Weight of a hopeless prompt (p -> 0)")
    axes[2].set(xscale="log", yscale="log", xlabel="group size G", ylabel="c(1-)/G  (log)",
                title="Weight of a near-solved prompt (p -> 1)")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    for ax in axes[1:]:
        ax.set_xticks(sizes, [str(s) for s in sizes], fontsize=8)
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out / "large_group.png")


def plot_budget_shares(out: Path) -> Path:
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("RdYlGn")([0.05, 0.3, 0.5, 0.7, 0.95])
    entries = roster()
    fig, axes = plt.subplots(2, 2, figsize=(14, 7.5), sharey=True)
    for col, g in enumerate((8, 16)):
        shares = share_rows(entries, g)
        for row, norm in enumerate(("l1", "l2")):
            ax = axes[row, col]
            labels = list(shares[norm])[::-1]
            left = [0.0] * len(labels)
            for b, bucket in enumerate(SHOWN_BUCKETS):
                width = [shares[norm][lab][b] for lab in labels]
                ax.barh(labels, width, left=left, color=colors[b], edgecolor="white", label=bucket)
                for y, (x0, w) in enumerate(zip(left, width)):
                    if w > 0.06:
                        ax.text(x0 + w / 2, y, f"{w:.0%}", ha="center", va="center", fontsize=7.5)
                left = [x + w for x, w in zip(left, width)]
            for y, lab in enumerate(labels):
                ax.text(1.01, y, f"{shares[norm][lab][-1]:.3f}", va="center", fontsize=8)
            ax.set_xlim(0, 1)
            ax.set_title(f"{norm.upper()} share, G = {g}   (right: near/hard)")
            ax.set_xlabel("share of the gradient budget, p ~ U(0,1)")
    axes[0, 1].legend(loc="upper left", bbox_to_anchor=(1.1, 1), title="bucket (K/G)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out / "budget_shares.png")


def plot_expected_budget(out: Path) -> Path:
    import matplotlib.pyplot as plt

    p = torch.linspace(0, 1, 201, dtype=F64)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, g in zip(axes, (8, 16)):
        pmf = binomial_pmf(p, g)  # [201, G+1]
        for e in roster():
            ax.plot(p, pmf @ binary_budgets(e.estimator, g)[0] / g, **e.line, lw=1.8)
        ax.set(title=f"G = {g}", xlabel="pass rate p")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("E[sum_i |A_i|] / G  (L1 budget per rollout)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out / "expected_budget.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: small tensors)")
    args = artefact.publish_option(parser).parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    sections = tables()
    print("\n\n".join(sections))
    path = write_markdown(args.out / "tables.md", "Population theory of the advantage estimators", sections)
    written = [path]
    if not args.no_plots:
        use_agg_backend()
        for plot in (plot_weights, plot_objectives, plot_large_group, plot_budget_shares, plot_expected_budget):
            written.append(plot(args.out))
    report = "# Population theory of the advantage estimators\n\n" + "\n\n".join(sections)
    written.append(artefact.publish_run(args, "population", key_figures(), report, __file__, argv))
    print(f"\nwrote {', '.join(str(p) for p in written if p)} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
