"""Paired comparison: one fixed rollout batch fed to every estimator, so sampling noise cancels.

A tiny char-level Llama (``sgrpo.model.tiny``, randomly initialised; or ``--model PATH``, e.g. a warm-started
one from ``python -m sgrpo.warmstart --out PATH``) samples G completions for each of B synthetic
prompts (``tasks.synthetic.SyntheticTask``) with the HF rollout engine. Rewards:

* ``--reward table`` (default): an untrained model solves nothing, so each prompt b gets a pass
  rate p_b spread evenly over (0, 1) ((b + 1/2) / B) and rollout g of prompt b is rewarded
  1[u_bg < p_b], with u drawn from ``--seed``: a reward table over real rollouts, with every
  difficulty represented;
* ``--reward task``: the task's own reward (exact match), for a model that solves some prompts.

From the one batch it computes, for every estimator of the roster: the advantages of a few groups
side by side; the per-rollout score vectors s_i = grad log pi(o_i) (``sgrpo.model.logprobs.completion_logprobs``,
one backward per rollout) and from them the policy gradient g_e = sum_i A_i s_i, i.e. the gradient of
sum_i A_i log pi(o_i) (checked once against autograd on the full surrogate); the cosine similarity
between the estimators' gradients; and the budget by difficulty, both as advantage mass
(``gradient_budget``, groups bucketed by K/G) and as per-group gradient norms ||sum_{i in group} A_i s_i||
(the direct measurement of docs/gradient_budget.md §6). A second, independent batch (``--seed + 1``) gives the cosine
between an estimator's gradients on two batches: the sampling noise that pairing removes.

Outputs in ``--out`` (default ``benchmarks/results/paired/``): ``results.md``, ``cosine.png`` and
``budget.png``; tables are printed. Memory: the score matrix is N x parameters floats (68 MB here).

    python benchmarks/paired.py [--prompts 16] [--group-size 8] [--seed 0] [--model PATH --reward task] [--no-publish]

The tables are published to ``benchmarks/reports/paired/`` (``benchmarks/artefact.py``).
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
from torch import Tensor, nn  # noqa: E402

from benchmarks import artefact  # noqa: E402
from benchmarks._common import (  # noqa: E402
    SHOWN_BUCKETS,
    Entry,
    HelpFormatter,
    markdown_table,
    ratio,
    roster,
    save_figure,
    use_agg_backend,
    write_markdown,
)
from estimators import BUCKETS, difficulty_bucket, gradient_budget  # noqa: E402

F64 = torch.float64
DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "paired"


@dataclass
class Batch:
    """One fixed rollout batch: rewards ``[B, G]`` and the Gram matrix of the score vectors."""

    rewards: Tensor  # [B, G] float64
    gram: Tensor  # [N, N] float64, s_i . s_j
    scores: Tensor  # [N, params] float32, s_i = grad log pi(o_i)
    rollout: object  # sgrpo.types.RolloutBatch: ids and masks of the N = B * G rollouts
    prompts: list[str]


def load_policy(model_path: Path | None, seed: int):
    """The tiny char-level Llama (built offline) or a saved model, and its tokenizer."""
    if model_path is None:
        from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama

        tokenizer = build_char_tokenizer()
        return build_tiny_llama(tokenizer, seed=seed), tokenizer
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # not AutoTokenizer: it can silently swap a custom char tokenizer (design notes §6)
    return AutoModelForCausalLM.from_pretrained(model_path), PreTrainedTokenizerFast.from_pretrained(model_path)


def score_vectors(model: nn.Module, rollout, group_size: int) -> Tensor:
    """``[N, params]`` float32: grad of each rollout's sequence log-prob, one group forward at a time."""
    from sgrpo.model.logprobs import completion_logprobs

    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for start in range(0, rollout.input_ids.shape[0], group_size):
        rows_ = slice(start, start + group_size)
        logp, _ = completion_logprobs(
            model, rollout.input_ids[rows_], rollout.attention_mask[rows_], rollout.completion_mask[rows_]
        )  # [G, T]
        seq = logp.sum(-1)  # [G]
        for i in range(seq.shape[0]):
            grads = torch.autograd.grad(seq[i], params, retain_graph=i < seq.shape[0] - 1)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def sample_batch(model, tokenizer, args: argparse.Namespace, seed: int) -> Batch:
    from sgrpo.rollout import HFRollout
    from tasks.synthetic import SyntheticTask

    b, g = args.prompts, args.group_size
    task = SyntheticTask(kind=args.task, num_train=b, seed=seed)
    examples = list(task.examples("train"))
    torch.manual_seed(seed)
    rollout = HFRollout(max_new_tokens=args.max_new_tokens, temperature=1.0).generate(model, tokenizer, examples, g)
    if args.reward == "task":
        repeated = [ex for ex in examples for _ in range(g)]
        rewards = task.reward(repeated, rollout.completions).to(F64).view(b, g)
    else:
        gen = torch.Generator().manual_seed(seed)
        pass_rate = (torch.arange(b, dtype=F64) + 0.5) / b  # [B]
        rewards = (torch.rand(b, g, generator=gen, dtype=F64) < pass_rate.unsqueeze(-1)).to(F64)  # [B, G]
    model.train()
    scores = score_vectors(model, rollout, g)  # [N, params]
    gram = (scores @ scores.T).to(F64)  # [N, N]
    return Batch(rewards, gram, scores, rollout, [str(ex.prompt) for ex in examples])


def surrogate_check(model: nn.Module, batch: Batch, adv: Tensor) -> float:
    """Relative difference between A^T S and autograd's gradient of sum_i A_i log pi(o_i) on the batch."""
    from sgrpo.model.logprobs import completion_logprobs

    r = batch.rollout
    logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)  # [N, T]
    surrogate = (adv.flatten().to(logp.dtype) * logp.sum(-1)).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    direct = torch.cat([g.reshape(-1) for g in torch.autograd.grad(surrogate, params)])
    via_scores = adv.flatten().to(batch.scores.dtype) @ batch.scores
    return ((direct - via_scores).norm() / direct.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------- analysis
def cosine_matrix(adv: Tensor, gram: Tensor) -> tuple[Tensor, Tensor]:
    """``adv`` ``[E, N]``: (cosine ``[E, E]``, norms ``[E]``) of g_e = sum_i A_ei s_i via the Gram matrix."""
    inner = adv @ gram @ adv.T  # [E, E]
    norms = inner.diagonal().clamp_min(0).sqrt()
    return inner / (norms.unsqueeze(0) * norms.unsqueeze(1)).clamp_min(1e-300), norms


def group_norms(adv: Tensor, gram: Tensor, group_size: int) -> Tensor:
    """``[E, B]``: ||sum_{i in group b} A_ei s_i||, from the within-group blocks of the Gram matrix."""
    e, n = adv.shape
    b = n // group_size
    blocks = gram.view(b, group_size, b, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [B, G, G]
    a = adv.view(e, b, group_size)
    return torch.einsum("ebi,bij,ebj->eb", a, blocks, a).clamp_min(0).sqrt()


def bucket_shares(per_group: Tensor, success_rate: Tensor) -> Tensor:
    """Share of a per-group quantity ``[E, B]`` by difficulty bucket: ``[E, len(BUCKETS)]``."""
    idx = difficulty_bucket(success_rate)  # [B]
    mass = torch.zeros(per_group.shape[0], len(BUCKETS), dtype=F64).index_add_(1, idx, per_group.to(F64))
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)


def pick_groups(rewards: Tensor, count: int = 4) -> list[int]:
    """Up to ``count`` non-degenerate groups with distinct success counts K, spread from low to high."""
    k = rewards.sum(-1).long()
    g = rewards.shape[-1]
    first = {}
    for idx, kk in enumerate(k.tolist()):
        if 0 < kk < g:
            first.setdefault(kk, idx)
    ks = sorted(first)
    if len(ks) > count:
        ks = [ks[round(i * (len(ks) - 1) / (count - 1))] for i in range(count)]
    return [first[kk] for kk in ks]


def tables(entries: list[Entry], args, batch: Batch, other: Batch | None, check: float) -> tuple[list[str], dict]:
    g = args.group_size
    labels = [e.label for e in entries]
    adv = torch.stack([e.estimator(batch.rewards) for e in entries])  # [E, B, G]
    flat = adv.view(len(entries), -1)  # [E, N]
    cos, norms = cosine_matrix(flat, batch.gram)
    k = batch.rewards.sum(-1)  # [B]
    sections = []

    chosen = pick_groups(batch.rewards)
    head = ["estimator", *(f"group {b}: K={int(k[b])}/{g}" for b in chosen)]
    rows = []
    for i, label in enumerate(labels):
        cells = []
        for b in chosen:
            success = adv[i, b][batch.rewards[b] == 1][0].item()
            failure = adv[i, b][batch.rewards[b] == 0][0].item()
            cells.append(f"{success:+.3f} / {failure:+.3f}")
        rows.append([label, *cells])
    sections.append(
        "## Advantages on the same groups (success / failure)\n\n"
        + "\n".join(f"- group {b}: prompt `{batch.prompts[b]}`, rewards {batch.rewards[b].int().tolist()}"
                    for b in chosen)
        + "\n\n" + markdown_table(head, rows)
    )

    sections.append(
        "## Cosine similarity of the policy gradients g_e = grad sum_i A_i log pi(o_i), same rollouts\n\n"
        + markdown_table(["", *labels], [[lab, *(f"{v:.3f}" for v in cos[i].tolist())] for i, lab in enumerate(labels)])
    )

    norm_rows = []
    cross = None
    if other is not None:
        adv2 = torch.stack([e.estimator(other.rewards) for e in entries]).view(len(entries), -1)
        g1 = flat.to(torch.float32) @ batch.scores  # [E, params]
        g2 = adv2.to(torch.float32) @ other.scores
        cross = nn.functional.cosine_similarity(g1, g2, dim=-1)  # [E]
    for i, label in enumerate(labels):
        row = [label, f"{norms[i].item():.3f}", f"{norms[i].item() / norms[labels.index('RLOO')].item():.3f}"]
        row.append(f"{cross[i].item():.3f}" if cross is not None else "n/a")
        norm_rows.append(row)
    sections.append(
        "## Gradient norms, and the cosine with the same estimator's gradient on an independent batch\n\n"
        + markdown_table(["estimator", "norm(g_e)", "norm(g_e) / norm(g_RLOO)", "cos(g_e, g_e on batch 2)"], norm_rows)
    )

    rate = k / g
    adv_share = torch.stack([
        torch.stack([gradient_budget(adv[i], rate)[f"l1/{b}"] for b in BUCKETS]) for i in range(len(entries))
    ])  # [E, buckets]
    gnorm = group_norms(flat, batch.gram, g)  # [E, B]
    grad_share = bucket_shares(gnorm, rate)  # [E, buckets]
    near, hard = BUCKETS.index("near_solved"), BUCKETS.index("hard")
    counts = torch.bincount(difficulty_bucket(rate), minlength=len(BUCKETS))
    budget_rows = []
    for i, label in enumerate(labels):
        cells = [f"{adv_share[i, BUCKETS.index(b)]:.1%} / {grad_share[i, BUCKETS.index(b)]:.1%}" for b in SHOWN_BUCKETS]
        budget_rows.append([
            label, *cells,
            f"{ratio(adv_share[i, near].item(), adv_share[i, hard].item()):.3f}",
            f"{ratio(grad_share[i, near].item(), grad_share[i, hard].item()):.3f}",
        ])
    groups_line = ", ".join(f"{b} {int(counts[BUCKETS.index(b)])}" for b in BUCKETS)
    sections.append(
        "## Budget by difficulty, same rollouts: advantage L1 share / per-group gradient-norm share\n\n"
        f"Groups per bucket (by K/G): {groups_line}. Check: norm(A^T S - autograd grad of sum_i A_i log pi(o_i)) "
        f"/ norm(grad) = {check:.1e} (GRPO).\n\n"
        + markdown_table(
            ["estimator", *SHOWN_BUCKETS, "near/hard (adv L1)", "near/hard (grad norm)"], budget_rows
        )
    )
    return sections, {"cos": cos, "labels": labels, "adv_share": adv_share, "grad_share": grad_share}


def plot_all(out: Path, data: dict, args) -> list[Path]:
    import matplotlib.pyplot as plt

    labels, cos = data["labels"], data["cos"].numpy()
    fig, ax = plt.subplots(figsize=(8.2, 7))
    low = max(-1.0, float(cos.min()) // 0.05 * 0.05)  # colour range from the smallest cosine: differences show
    im = ax.imshow(cos, cmap="viridis", vmin=low, vmax=1)
    ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    for i in range(len(labels)):
        for j in range(len(labels)):
            ax.text(j, i, f"{cos[i, j]:.3f}", ha="center", va="center", fontsize=8,
                    color="black" if cos[i, j] > low + 0.6 * (1 - low) else "white")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="cosine similarity")
    ax.set_title(f"Policy-gradient cosine, one fixed batch ({args.prompts} prompts x G = {args.group_size})")
    paths = [save_figure(fig, out / "cosine.png")]

    colors = plt.get_cmap("RdYlGn")([0.05, 0.3, 0.5, 0.7, 0.95])
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2), sharey=True)
    rev = labels[::-1]
    titles = ("advantage L1 share", "per-group gradient-norm share")
    for ax, key, title in zip(axes, ("adv_share", "grad_share"), titles):
        share = data[key].flip(0)
        left = torch.zeros(len(labels), dtype=F64)
        for b, bucket in enumerate(SHOWN_BUCKETS):
            width = share[:, BUCKETS.index(bucket)]
            ax.barh(rev, width, left=left, color=colors[b], edgecolor="white", label=bucket)
            for y, (x0, w) in enumerate(zip(left.tolist(), width.tolist())):
                if w > 0.06:
                    ax.text(x0 + w / 2, y, f"{w:.0%}", ha="center", va="center", fontsize=7.5)
            left += width
        ax.set_xlim(0, 1)
        ax.set(title=f"{title} (same rollouts)", xlabel="share, groups bucketed by K/G")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), title="bucket (K/G)", fontsize=9)
    fig.tight_layout()
    paths.append(save_figure(fig, out / "budget.png"))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="B, prompts in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--seed", type=int, default=0, help="model init, prompts, sampling and reward table")
    parser.add_argument("--task", choices=("sort", "add", "dsum"), default="sort", help="SyntheticTask kind")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="completion length cap")
    parser.add_argument("--model", type=Path, default=None, help="a saved HF model (default: a fresh tiny Llama)")
    parser.add_argument("--reward", choices=("table", "task"), default="table", help="see above")
    parser.add_argument("--no-second-batch", action="store_true", help="skip the independent-batch cosine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: small tensors)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = artefact.publish_option(parser).parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_policy(args.model, args.seed)
    batch = sample_batch(model, tokenizer, args, args.seed)
    other = None if args.no_second_batch else sample_batch(model, tokenizer, args, args.seed + 1)
    entries = roster()
    check = surrogate_check(model, batch, entries[0].estimator(batch.rewards))
    sections, data = tables(entries, args, batch, other, check)
    source = args.model or f"random init, seed {args.seed}"
    setup = (
        f"Setup: {args.prompts} `{args.task}` prompts x G = {args.group_size}, tiny Llama "
        f"({sum(p.numel() for p in model.parameters()):,} parameters, {source}), "
        f"rewards `{args.reward}`, mean reward {batch.rewards.mean().item():.3f}; completions e.g. "
        f"{batch.rollout.completions[:3]}"
    )
    sections.insert(0, setup)
    print("\n\n".join(sections))
    title = "Paired estimator comparison on one rollout batch"
    written = [write_markdown(args.out / "results.md", title, sections)]
    if not args.no_plots:
        use_agg_backend()
        written += plot_all(args.out, data, args)
    result = {"labels": data["labels"], "cosine": data["cos"].tolist(), "surrogate_check": check,
              "l1_share": data["adv_share"].tolist(), "grad_norm_share": data["grad_share"].tolist()}  # fmt: skip
    report = f"# {title}\n\n" + "\n\n".join(sections)
    written.append(artefact.publish_run(args, "paired", result, report, __file__, argv))
    print(f"\ntotal {time.perf_counter() - start:.1f} s wall; wrote {', '.join(str(p) for p in written if p)}")


if __name__ == "__main__":
    main()
