"""Is the L1 budget a fair proxy for gradient share? Advantage mass against per-group update norms.

docs/gradient_budget.md §6 shows that for binary rewards and a zero-sum estimator a group's update is
``U = (B1 / 2) (mean score of its successes - mean score of its failures)``, so ``||U|| = (B1/2) D`` with
D independent of the estimator. This measures both sides on real rollouts of the quickstart model
(``sgrpo/assets/quickstart_model``, the SFT warm start on sort 3/5/7) on sort levels ``--levels``
(default 3, 5, 7: the quickstart's own mix of easy and hard prompts), reward: exact match:

* per rollout the score s_i = grad log pi(o_i) (``benchmarks/paired.py``'s ``score_vectors``, one backward
  per rollout), per group ``||sum_i A_i s_i||`` from the Gram matrix, for every estimator of the roster;
* the identity check ``max | ||U|| - (B1/2) D | / ||U||`` over mixed groups;
* per seed and estimator, near-solved/hard ratios of (a) the L1 advantage mass (``gradient_budget``)
  and (b) the summed group-update norms, groups bucketed by K/G.

    python benchmarks/budget_norms.py [--seeds 5] [--prompts 48] [--publish]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from benchmarks._common import HelpFormatter, markdown_table, roster  # noqa: E402
from benchmarks.paired import bucket_shares, group_norms, load_policy, score_vectors  # noqa: E402
from estimators import BUCKETS, gradient_budget  # noqa: E402

F64 = torch.float64
MODEL = _ROOT / "sgrpo" / "assets" / "quickstart_model"
NEAR, HARD = BUCKETS.index("near_solved"), BUCKETS.index("hard")


def sample(model, tokenizer, args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards ``[B, G]`` (exact match) and scores ``[B G, params]`` of one sampled batch."""
    from sgrpo.rollout import HFRollout
    from tasks.synthetic import SyntheticTask

    b, g = args.prompts, args.group_size
    task = SyntheticTask(kind="sort", levels=args.levels, num_train=b, seed=seed)
    examples = list(task.examples("train"))
    torch.manual_seed(seed)
    rollout = HFRollout(max_new_tokens=args.max_new_tokens, temperature=1.0).generate(model, tokenizer, examples, g)
    rewards = task.reward([ex for ex in examples for _ in range(g)], rollout.completions).to(F64).view(b, g)
    model.train()
    return rewards, score_vectors(model, rollout, g)


def measure(args: argparse.Namespace) -> dict:
    model, tokenizer = load_policy(MODEL, 0)
    entries = roster()
    ratios = {e.label: {"l1": [], "norm": []} for e in entries}
    worst, groups = 0.0, {"hard": 0, "near_solved": 0, "mixed": 0}
    for seed in range(args.seeds):
        rewards, scores = sample(model, tokenizer, args, seed)
        gram = (scores @ scores.T).to(F64)
        rate = rewards.mean(-1)
        mixed = (rate > 0) & (rate < 1)
        groups["mixed"] += int(mixed.sum())
        groups["hard"] += int(((rate > 0) & (rate <= 0.25)).sum())
        groups["near_solved"] += int(((rate >= 0.75) & (rate < 1)).sum())
        s = scores.to(F64).view(args.prompts, args.group_size, -1)
        win = (rewards.unsqueeze(-1) * s).sum(1) / rewards.sum(-1, keepdim=True).clamp_min(1)
        lose = ((1 - rewards).unsqueeze(-1) * s).sum(1) / (1 - rewards).sum(-1, keepdim=True).clamp_min(1)
        d = (win - lose).norm(dim=-1)  # [B]
        for e in entries:
            adv = e.estimator(rewards)  # [B, G]
            norm = group_norms(adv.reshape(1, -1), gram, args.group_size)[0]  # [B]
            b1 = adv.abs().sum(-1)
            gap = ((norm - b1 / 2 * d).abs() / norm.clamp_min(1e-300))[mixed]
            worst = max(worst, gap.max().item() if len(gap) else 0.0)
            l1 = gradient_budget(adv, rate)
            share = bucket_shares(norm.unsqueeze(0), rate)[0]
            ratios[e.label]["l1"].append((l1["l1/near_solved"] / l1["l1/hard"]).item())
            ratios[e.label]["norm"].append((share[NEAR] / share[HARD]).item())
    return {"ratios": ratios, "identity_max_rel_gap": worst, "groups": groups}


def report(result: dict, args: argparse.Namespace) -> str:
    rows = []
    for label, r in result["ratios"].items():
        l1, norm = torch.tensor(r["l1"]), torch.tensor(r["norm"])
        off = (norm / l1 - 1).abs().max().item()
        rows.append([label, f"{l1.min():.2f}-{l1.max():.2f}", f"{norm.min():.2f}-{norm.max():.2f}",
                     f"{l1.mean():.2f}", f"{norm.mean():.2f}", f"{off:.0%}"])  # fmt: skip
    g = result["groups"]
    return "\n\n".join([
        "# Budget proxy: L1 advantage mass against per-group update norms",
        f"Quickstart model, sort levels {args.levels}, {args.prompts} prompts x G = {args.group_size} per seed, "
        f"{args.seeds} seeds (batches); {g['mixed']} mixed groups, {g['hard']} hard, {g['near_solved']} near-solved.",
        f"Identity ||U|| = (B1/2) ||mean s(successes) - mean s(failures)||: largest relative gap "
        f"{result['identity_max_rel_gap']:.1e} over mixed groups and estimators.",
        "## Near-solved / hard ratio per batch (range over seeds, then mean)",
        markdown_table(["estimator", "L1 mass (range)", "update norms (range)", "L1 mass (mean)",
                        "update norms (mean)", "largest |norm/L1 - 1|"], rows),  # fmt: skip
    ])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="independent batches")
    parser.add_argument("--prompts", type=int, default=48, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--levels", type=int, nargs="+", default=[3, 5, 7], help="sort levels")
    parser.add_argument("--max-new-tokens", type=int, default=11, help="completion length cap")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--publish", action="store_true", help="publish benchmarks/reports/budget_norms")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    text = report(result, args)
    print(text)
    if args.publish:
        from benchmarks.artefact import publish

        given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--publish"]
        command = (".venv/bin/python benchmarks/budget_norms.py " + shlex.join(given)).strip()
        publish("budget_norms", result, text, command)
    return result


if __name__ == "__main__":
    main()
