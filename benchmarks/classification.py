"""Classification as RL at CPU scale: a many-class classifier trained only from sampled-label rewards.

The SoftmaxGRPO paper trains ResNet-50 on ImageNet from rewards alone: each image samples many labels
from the policy, a label scores 1 if it is the true class, and the advantages come from the estimator
(SoftmaxGRPO tau 0.2). This is the same experiment on a synthetic problem that runs on two CPU cores.

Problem (one per seed). ``--classes`` C classes with prototypes mu_c ~ N(0, I_d); an input of class c is
``x = mu_c + sigma_c eps``, eps ~ N(0, I_d), with per-class noise ``sigma_c = --noise * exp(--spread u_c)``,
u_c ~ U(-1, 1): ``--spread`` sets how unequal the classes' difficulty is. Training draws fresh inputs
every step (uniform classes); a fixed test set of ``--test-per-class`` inputs per class is the evaluation.

Policy: a network ``d -> hidden (ReLU) -> C`` (``--hidden 0``: linear), output layer zero at the start
(the uniform policy, p = 1/C for every input). Each step: ``--batch`` inputs, G = ``--group-size``
labels sampled per input from the softmax, reward 1 for the true class, advantages ``A = est(rewards)``
from the estimator's own ``__call__`` (the class used in LM training), and one SGD step along
``(1/(B G)) sum_x sum_i A_i grad log pi(y_i | x)``, the mean over the step's rollouts as the LM loss's
``token_mean`` for one-token completions (gradient by hand: d/dlogits = sum_i A_i (onehot(y_i) - pi)).

Fairness, as ``benchmarks/bandit.py``: every estimator and seed runs in one vectorised loop with common
random numbers (per seed: the same problem, initial weights, inputs and uniform draws for the label
sampling, by inverse CDF), and learning rates normalised by the objective: ``lr_e = lr / (F_G(1)/G)``,
so every estimator has the same mean weight per rollout over p ~ U(0, 1) and they differ only in how it
is spread over difficulty. Under it RLOO and Dr.GRPO take identical steps (a built-in check).

Metrics on the test set, per estimator and seed: top-1 accuracy (argmax), exact pass@1 (the policy's
probability of the true class, averaged) and exact pass@k = 1 - (1 - p)^k from the softmax, k in
``--k``, also on the easiest / hardest third of the classes (by sigma_c). Head to head: the seed-paired
difference to GRPO with a 95 % Student-t interval over seeds.

    python benchmarks/classification.py                    # the reported run (publish with --publish)
    python benchmarks/classification.py --quick            # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks._common import Entry, HelpFormatter, markdown_table, t_interval, write_markdown  # noqa: E402
from estimators import GRPO, RLOO, DrGRPO, MaxRL, SoftmaxGRPO  # noqa: E402

DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "classification"
QUICK = ["--classes", "40", "--dim", "8", "--hidden", "16", "--steps", "30", "--seeds", "2", "--batch", "32",
         "--group-size", "8", "--k", "5", "32", "--test-per-class", "5", "--evals", "2"]  # fmt: skip


def entries(tau: float) -> list[Entry]:
    """The roster: GRPO (reference), Dr.GRPO, RLOO, MaxRL (practical), SoftmaxGRPO at ``tau``."""
    return [
        Entry("GRPO", GRPO(), "#d62728"),
        Entry("Dr.GRPO", DrGRPO(), "#ff7f0e", "--"),
        Entry("RLOO", RLOO(), "#8c564b"),
        Entry("MaxRL", MaxRL(), "#000000"),
        Entry(f"SoftmaxGRPO tau={tau:g}", SoftmaxGRPO(temperature=tau), "#2171b5"),
    ]


@dataclass
class Problem:
    """S synthetic problems: prototypes ``[S, C, d]``, noise ``[S, C]``, test set ``[S, N, d]`` / ``[S, N]``."""

    mu: Tensor
    sigma: Tensor
    test_x: Tensor
    test_y: Tensor

    def sample(self, classes: Tensor, gen: list[torch.Generator]) -> Tensor:
        """Inputs ``[S, B, d]`` of the given classes ``[S, B]``, one generator per seed."""
        eps = torch.stack([torch.randn(classes.shape[1], self.mu.shape[-1], generator=g) for g in gen])
        rows = torch.arange(len(gen)).unsqueeze(1)
        return self.mu[rows, classes] + self.sigma[rows, classes].unsqueeze(-1) * eps


def make_problem(args: argparse.Namespace, gens: list[torch.Generator]) -> Problem:
    c, d = args.classes, args.dim
    mu = torch.stack([torch.randn(c, d, generator=g) for g in gens])
    u = torch.stack([torch.rand(c, generator=g) * 2 - 1 for g in gens])
    sigma = args.noise * torch.exp(args.spread * u)
    test_y = torch.arange(c).repeat(args.test_per_class).expand(len(gens), -1)
    problem = Problem(mu, sigma, torch.empty(0), test_y)
    problem.test_x = problem.sample(test_y, gens)
    return problem


def init_params(e_count: int, args: argparse.Namespace, gens: list[torch.Generator]) -> dict[str, Tensor]:
    """``[E, S, ...]`` weights: He-initialised hidden layer (the same for every estimator of a seed), zero output."""
    s, d, h, c = len(gens), args.dim, args.hidden, args.classes
    width = h or d
    params = {"w2": torch.zeros(e_count, s, width, c), "b2": torch.zeros(e_count, s, 1, c)}
    if h:
        w1 = torch.stack([torch.randn(d, h, generator=g) * (2 / d) ** 0.5 for g in gens])
        params["w1"] = w1.expand(e_count, -1, -1, -1).clone()
        params["b1"] = torch.zeros(e_count, s, 1, h)
    return params


def features(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """Hidden activations ``[E, S, B, width]`` for inputs ``x`` ``[S, B, d]``."""
    if "w1" not in params:
        return x.expand(params["w2"].shape[0], -1, -1, -1)
    return torch.relu(x @ params["w1"] + params["b1"])


def evaluate(params: dict[str, Tensor], problem: Problem, ks: list[int], chunk: int = 500) -> Tensor:
    """Per-input test metrics ``[E, S, N, 2 + len(ks)]``: top-1 hit, p(true class), pass@k for each k."""
    out = []
    for start in range(0, problem.test_x.shape[1], chunk):
        x, y = problem.test_x[:, start:start + chunk], problem.test_y[:, start:start + chunk]
        logits = features(params, x) @ params["w2"] + params["b2"]  # [E, S, n, C]
        idx = y.expand(logits.shape[0], -1, -1).unsqueeze(-1)
        true = logits.gather(-1, idx).squeeze(-1)
        p = (true - logits.logsumexp(-1)).double().exp()  # [E, S, n]
        top1 = (logits.argmax(-1) == idx.squeeze(-1)).double()
        out.append(torch.stack([top1, p, *(-torch.expm1(k * torch.log1p(-p)) for k in ks)], -1))
    return torch.cat(out, 2)


def logit_gradient(pi: Tensor, labels: Tensor, adv: Tensor) -> Tensor:
    """``d/dlogits sum_i A_i log pi(y_i) = sum_i A_i (onehot(y_i) - pi)``: ``pi [..., C]`` (overwritten),
    ``labels`` / ``adv`` ``[..., G]``."""
    return pi.mul_(adv.sum(-1, keepdim=True).neg_()).scatter_add_(-1, labels, adv)


def train(roster: list[Entry], args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    e_count, s_count, g, b = len(roster), args.seeds, args.group_size, args.batch
    gens = [torch.Generator().manual_seed(args.seed * 1_000_003 + s) for s in range(s_count)]
    problem = make_problem(args, gens)
    params = init_params(e_count, args, gens)
    norm = [e.estimator.population_objective(1.0, g).item() / g for e in roster]
    lr = torch.tensor([args.lr / n for n in norm]).view(-1, 1, 1, 1)
    curve, eval_steps = [], sorted({round(i * args.steps / args.evals) for i in range(args.evals + 1)})
    for step in range(args.steps + 1):
        if step in eval_steps:
            curve.append(evaluate(params, problem, args.k).mean(2))  # [E, S, metrics]
        if step == args.steps:
            break
        classes = torch.stack([torch.randint(args.classes, (b,), generator=gen) for gen in gens])  # [S, B]
        x = problem.sample(classes, gens)  # [S, B, d]
        u = torch.stack([torch.rand(b, g, generator=gen) for gen in gens])  # [S, B, G], shared by all estimators
        hidden = features(params, x)  # [E, S, B, width]
        pi = torch.softmax(hidden @ params["w2"] + params["b2"], -1)  # [E, S, B, C]
        draws = u.expand(e_count, -1, -1, -1).contiguous()
        labels = torch.searchsorted(pi.cumsum(-1), draws).clamp_(max=args.classes - 1)  # inverse CDF
        reward = (labels == classes.unsqueeze(-1)).float()  # [E, S, B, G]
        adv = torch.stack([e.estimator(reward[i].reshape(-1, g)) for i, e in enumerate(roster)]).view_as(reward)
        grad = logit_gradient(pi, labels, adv).div_(b * g)  # the mean over the B G rollouts
        step_w2 = hidden.transpose(-1, -2) @ grad
        if "w1" in params:
            back = (grad @ params["w2"].transpose(-1, -2)) * (hidden > 0)  # [E, S, B, hidden]
            params["w1"] += lr * (x.unsqueeze(0).transpose(-1, -2) @ back)
            params["b1"] += lr * back.sum(2, keepdim=True)
        params["w2"] += lr * step_w2
        params["b2"] += lr * grad.sum(2, keepdim=True)
    final = evaluate(params, problem, args.k)  # [E, S, N, metrics]
    third = args.classes // 3
    order = problem.sigma.argsort(-1)  # [S, C] easiest first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(args.classes).expand_as(order))
    test_rank = rank.gather(-1, problem.test_y)  # [S, N]
    easy, hard = (test_rank < third).double(), (test_rank >= args.classes - third).double()
    by_third = [(final * m.unsqueeze(-1)).sum(2) / m.sum(-1).view(1, -1, 1) for m in (easy, hard)]
    return {"curve": torch.stack(curve), "steps": eval_steps, "easy": by_third[0], "hard": by_third[1],
            "lr": [args.lr / n for n in norm], "seconds": time.perf_counter() - start}  # fmt: skip


# ---------------------------------------------------------------------------------------------- report
def metric_names(args: argparse.Namespace) -> list[str]:
    return ["top-1", "pass@1", *(f"pass@{k}" for k in args.k)]


def summarise(roster: list[Entry], run: dict, args: argparse.Namespace) -> dict:
    """Means, t-intervals and GRPO-paired differences (in points, 100 x fractions) per estimator and metric."""
    final, names = run["curve"][-1], metric_names(args)  # [E, S, M]
    out = {"initial": {n: 100 * run["curve"][0, 0, :, j].mean().item() for j, n in enumerate(names)}, "estimators": {}}
    for i, e in enumerate(roster):
        row = {"lr": run["lr"][i]}
        for j, n in enumerate(names):
            mean, half = t_interval(100 * final[i, :, j])
            diff = 100 * (final[i, :, j] - final[0, :, j])
            d_mean, d_half = t_interval(diff)
            row[n] = {"mean": mean.item(), "half": half.item(), "diff": d_mean.item(), "diff_half": d_half.item(),
                      "seeds_for_1pt": seeds_for_half_width(diff.std().item()) if i else None}  # fmt: skip
        for part in ("easy", "hard"):
            row[f"top-1 {part} third"] = t_interval(100 * run[part][i, :, 0])[0].item()
        out["estimators"][e.label] = row
    return out


def seeds_for_half_width(sd: float, target: float = 1.0, most: int = 1000) -> int:
    """The smallest n with t(0.975, n - 1) sd / sqrt(n) <= target (paired differences of sd ``sd``)."""
    from scipy.stats import t as student_t

    return next((n for n in range(2, most) if student_t.ppf(0.975, n - 1) * sd / n**0.5 <= target), most)


def tables(summary: dict, run: dict, args: argparse.Namespace) -> list[str]:
    names = metric_names(args)
    head = ["estimator", "lr", *names, *(f"Δ {n} vs GRPO (pts)" for n in names)]
    rows = [["initial (uniform policy)", "", *(f"{summary['initial'][n]:.2f} %" for n in names), *[""] * len(names)]]
    for label, row in summary["estimators"].items():
        cells = [f"{row[n]['mean']:.2f} % ± {row[n]['half']:.2f}" for n in names]
        diffs = [f"{row[n]['diff']:+.2f} ± {row[n]['diff_half']:.2f}" for n in names]
        diffs = ["(reference)"] * len(names) if label == "GRPO" else diffs
        rows.append([label, f"{row['lr']:.4g}", *cells, *diffs])
    setup = (f"{args.classes} classes, d = {args.dim}, hidden {args.hidden}, noise {args.noise:g}, "
             f"spread {args.spread:g}; "
             f"{args.steps} steps x {args.batch} inputs x G = {args.group_size} labels; {args.seeds} seeds; "
             f"base lr {args.lr:g} (objective-normalised); test set {args.test_per_class} per class")  # fmt: skip
    summary_md = (f"## Final test metrics (mean ± 95 % t-interval over seeds; Δ: seed-paired vs GRPO)\n\n{setup}\n\n"
                  + markdown_table(head, rows))  # fmt: skip
    power = [[label, *(str(row[n]["seeds_for_1pt"]) for n in names)]
             for label, row in summary["estimators"].items() if label != "GRPO"]  # fmt: skip
    power_md = ("## Seeds for a +/- 1 point paired half-width vs GRPO (from the measured sd of the differences)\n\n"
                + markdown_table(["estimator", *names], power))  # fmt: skip
    third = [[label, f"{row['top-1 easy third']:.2f} %", f"{row['top-1 hard third']:.2f} %"]
             for label, row in summary["estimators"].items()]  # fmt: skip
    third_md = ("## Top-1 on the easiest and hardest third of the classes (by noise sigma_c; mean over seeds)\n\n"
                + markdown_table(["estimator", "easiest third", "hardest third"], third))  # fmt: skip
    curve = run["curve"][..., 0].mean(-1)  # [T, E] top-1 over steps
    curve_rows = [[label, *(f"{100 * curve[t, i].item():.2f}" for t in range(len(run["steps"])))]
                  for i, label in enumerate(summary["estimators"])]  # fmt: skip
    curve_md = ("## Test top-1 (%) over steps, mean over seeds\n\n"
                + markdown_table(["estimator", *(f"step {s}" for s in run["steps"])], curve_rows))  # fmt: skip
    return [summary_md, power_md, third_md, curve_md]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--classes", type=int, default=1000, help="number of classes C")
    parser.add_argument("--dim", type=int, default=32, help="input dimension d")
    parser.add_argument("--hidden", type=int, default=64, help="hidden ReLU units (0: a linear policy)")
    parser.add_argument("--noise", type=float, default=1.0, help="median per-class noise sigma")
    parser.add_argument("--spread", type=float, default=0.5, help="sigma_c = noise * exp(spread * U(-1, 1))")
    parser.add_argument("--steps", type=int, default=300, help="SGD steps")
    parser.add_argument("--batch", type=int, default=128, help="inputs per step")
    parser.add_argument("--group-size", type=int, default=256, help="G, labels sampled per input")
    parser.add_argument("--tau", type=float, default=0.2, help="SoftmaxGRPO temperature (the paper's ImageNet value)")
    parser.add_argument("--lr", type=float, default=8.0, help="base SGD learning rate (divided by F_G(1)/G)")
    parser.add_argument("--seeds", type=int, default=8, help="independent problems and runs")
    parser.add_argument("--seed", type=int, default=0, help="base seed")
    parser.add_argument("--k", type=int, nargs="+", default=[5, 256], help="k of the exact pass@k")
    parser.add_argument("--test-per-class", type=int, default=5, help="test inputs per class")
    parser.add_argument("--evals", type=int, default=6, help="test evaluations during training (plus step 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (results.md)")
    parser.add_argument("--publish", action="store_true", help="also publish benchmarks/reports/classification")
    parser.add_argument("--quick", action="store_true", help="a tiny problem for a smoke test (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args = parser.parse_args(QUICK + (argv or []))
        args.quick = True
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    roster = entries(args.tau)
    load = [round(x, 2) for x in os.getloadavg()]
    run = train(roster, args)
    summary = summarise(roster, run, args)
    sections = tables(summary, run, args)
    footer = (f"{len(roster)} estimators x {args.seeds} seeds x {args.steps} steps: {run['seconds']:.1f} s wall, "
              f"{args.threads} torch threads; load average at the start {load[0]} (1 min), {load[1]} (5 min)")
    print("\n\n".join(sections) + "\n\n" + footer)
    write_markdown(args.out / "results.md", "Classification as RL", [*sections, footer])
    if args.publish:
        from benchmarks.artefact import publish

        given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--publish"]
        command = ".venv/bin/python benchmarks/classification.py " + shlex.join(given)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {"summary": summary, "seconds": round(run["seconds"], 1), "load_at_start": load, "args": settings}
        report = "# Classification as RL\n\n" + "\n\n".join([*sections, footer])
        publish("classification", result, report, command.strip())
    return {"summary": summary, "run": run}


if __name__ == "__main__":
    main()
