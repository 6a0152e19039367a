"""Learning-rate sensitivity of ``benchmarks/classification.py``: the same run at several base learning rates.

``classification.py`` gives every estimator one base rate, normalised by its objective (as the bandit).
This runs the whole roster at each base rate of ``--lrs`` (same problems, seeds and random numbers) and
reports the final test top-1 and pass@1 per estimator and rate, and each estimator at its own best rate:
a check that the head-to-head does not hinge on one rate that happens to suit some estimators.
A best rate is only the best *of the rates run*: when it is the lowest or the highest rate of the grid, the
estimator's optimum may lie beyond it, and the report and ``result["best"][label]["edge"]`` say so.
Every other option is ``classification.py``'s (``--seeds``, ``--steps``, ...).

    python benchmarks/classification_lr.py [--lrs 2 8 32] [--seeds 4] [--publish]   (the defaults: 2 8 32, 4)
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks import classification as cls  # noqa: E402
from benchmarks._common import markdown_table, t_interval  # noqa: E402


def sweep(argv: list[str]) -> tuple[list[float], dict, object]:
    """Split ``--lrs`` off ``argv``, run the benchmark at each rate: ({lr: summary}, args)."""
    lrs, rest = [2.0, 8.0, 32.0], list(argv)
    if "--lrs" in rest:
        i = rest.index("--lrs")
        j = next((k for k in range(i + 1, len(rest)) if rest[k].startswith("--")), len(rest))
        lrs, rest = [float(x) for x in rest[i + 1:j]], rest[:i] + rest[j:]
    rest = ["--seeds", "4", *rest]
    results = {}
    for lr in lrs:
        args = cls.parse_args([*rest, "--lr", str(lr)])
        torch.set_num_threads(args.threads)
        roster = cls.entries(args.tau)
        run = cls.train(roster, args)
        results[lr] = {"summary": cls.summarise(roster, run, args), "seconds": run["seconds"],
                       "top1": (100 * run["curve"][-1, :, :, 0]).tolist()}  # fmt: skip
    return lrs, results, args


def report(lrs: list[float], results: dict, args) -> tuple[str, dict]:
    labels = list(results[lrs[0]]["summary"]["estimators"])
    rows, best = [], {}
    for label in labels:
        cells = []
        for lr in lrs:
            row = results[lr]["summary"]["estimators"][label]
            cells.append(f"{row['top-1']['mean']:.2f} ± {row['top-1']['half']:.2f} / {row['pass@1']['mean']:.2f}")
        top = max(lrs, key=lambda lr: results[lr]["summary"]["estimators"][label]["top-1"]["mean"])
        best[label] = {"lr": top, "top-1": results[top]["summary"]["estimators"][label]["top-1"]["mean"],
                       "edge": grid_edge(top, lrs)}  # fmt: skip
        rows.append([label, *cells, f"{top:g}" + (f" ({best[label]['edge']})" if best[label]["edge"] else "")])
    ref = torch.tensor(results[best["GRPO"]["lr"]]["top1"][0])  # GRPO at its best rate, per seed
    for i, label in enumerate(labels):
        diff = torch.tensor(results[best[label]["lr"]]["top1"][i]) - ref
        mean, half = t_interval(diff)
        best[label] |= {"diff": mean.item(), "diff_half": half.item()}
    best_rows = [[label, f"{b['lr']:g}", f"{b['top-1']:.2f} %", "(reference)" if label == "GRPO"
                  else f"{b['diff']:+.2f} ± {b['diff_half']:.2f}", EDGE_NOTE.get(b["edge"], "no")]
                 for label, b in best.items()]  # fmt: skip
    at_edge = [label for label, b in best.items() if b["edge"]]
    edge_text = ("Best rate at an edge of the grid, so the estimator's optimum may lie beyond the rates tried "
                 "(a rate outside the grid could do better than its best here): "
                 + "; ".join(f"{label} ({EDGE_NOTE[best[label]['edge']]})" for label in at_edge) + "."
                 if at_edge else "Every estimator's best rate lies inside the grid (neither its lowest nor its "
                 "highest rate).")  # fmt: skip
    seconds, grid = sum(r["seconds"] for r in results.values()), ", ".join(f"{lr:g}" for lr in lrs)
    text = "\n\n".join([
        "# Classification as RL: learning-rate sensitivity",
        f"{args.classes} classes, {args.steps} steps x {args.batch} inputs x G = {args.group_size}, {args.seeds} seeds "
        f"per rate, objective-normalised rates as in classification.py; base rates {grid}; "
        f"{seconds:.0f} s of training in all.",
        "## Final top-1 (%, mean ± 95 % t-interval) / pass@1 (%) by base learning rate",
        markdown_table(["estimator", *(f"lr {lr:g}" for lr in lrs), "best lr"], rows),
        "## Each estimator at its own best base rate; Δ top-1 vs GRPO at its best rate (seed-paired)",
        markdown_table(["estimator", "best lr", "top-1", "Δ top-1 vs GRPO (pts)", "best lr at a grid edge"],
                       best_rows),
        edge_text,
    ])
    return text, {"lrs": lrs, "seeds": args.seeds, "by_lr": {str(lr): r["summary"] for lr, r in results.items()},
                  "best": best, "at_edge": at_edge, "seconds": round(seconds, 1)}  # fmt: skip


#: what each value of ``grid_edge`` means, as the report words it
EDGE_NOTE = {"lowest": "lowest rate tried: the optimum may lie lower",
             "highest": "highest rate tried: the optimum may lie higher",
             "only": "the only rate tried"}  # fmt: skip


def grid_edge(lr: float, lrs: list[float]) -> str | None:
    """``"lowest"`` / ``"highest"`` when ``lr`` is the grid's smallest / largest rate (``"only"`` for a one-rate
    grid), else None: where a best rate says nothing about rates beyond the grid."""
    if len(set(lrs)) == 1:
        return "only"
    return "lowest" if lr == min(lrs) else "highest" if lr == max(lrs) else None


def main(argv: list[str] | None = None) -> dict:
    given = sys.argv[1:] if argv is None else list(argv)
    publish_it = "--publish" in given
    given = [a for a in given if a != "--publish"]
    lrs, results, args = sweep(given)
    text, result = report(lrs, results, args)
    print(text)
    if publish_it:
        from benchmarks.artefact import publish

        command = (".venv/bin/python benchmarks/classification_lr.py " + shlex.join(given)).strip()
        publish("classification_lr", result, text, command)
    return result


if __name__ == "__main__":
    main()
