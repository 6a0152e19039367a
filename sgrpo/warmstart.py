"""Warm-start the quickstart model: a tiny char-level Llama, briefly supervised on the synthetic ``sort`` task.

The SFT phase is stopped early on purpose: the model should solve short prompts
often and long ones rarely, so RL has headroom and a wide spread of per-prompt success rates.
Teacher forcing on ``prompt + answer + <eos>`` with the loss on the answer and ``<eos>`` only, over
consecutive batches of ``SyntheticTask("sort", seed=seed)``'s train split; accuracy is measured on its
validation split (whose first prompts are the ones an RL run on that task with the same seed validates on).

Regenerate the shipped asset (bitwise deterministic from the seed on a given machine; about 4 s of
training on an idle 2-core CPU)::

    python -m sgrpo.warmstart --out sgrpo/assets/quickstart_model --seed 0

It writes the model and tokenizer in HF format (safetensors) and ``warmstart.json`` with the recipe,
the training losses and the per-level accuracy (greedy and sampled at temperature 1).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sgrpo.model.logprobs import position_ids_from_mask
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.types import Example
from tasks.synthetic import SyntheticTask

DEFAULT_OUT = Path(__file__).parent / "assets" / "quickstart_model"


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the warm-started weights (with the machine's float arithmetic)."""

    seed: int = 0
    levels: tuple[int, ...] = (3, 5, 7)  # sort lengths n, balanced in every batch
    steps: int = 70
    batch_size: int = 64
    lr: float = 3e-3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4


def sft_batch(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> dict[str, Tensor]:
    """Left-padded ``prompt + answer + <eos>`` ids with labels (-100 except on answer and ``<eos>``)."""
    rows, targets = [], []
    for ex in examples:
        prompt = tokenizer.encode(str(ex.prompt), add_special_tokens=False)
        answer = tokenizer.encode(ex.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    return padded_batch(rows, targets, tokenizer.pad_token_id)


def padded_batch(rows: Sequence[list[int]], targets: Sequence[list[int]], pad_id: int) -> dict[str, Tensor]:
    """Rows of ids and their labels (-100: no loss), left-padded to the longest, as a model's keyword arguments."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, device="cpu")  # [B, L]
    labels = torch.full((len(rows), width), -100, device="cpu")  # [B, L]
    mask = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")  # [B, L]
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, width - len(row) :] = torch.tensor(row, device="cpu")
        labels[i, width - len(row) :] = torch.tensor(target, device="cpu")
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": position_ids_from_mask(mask)}


def make_task(recipe: Recipe, eval_prompts: int = 200) -> SyntheticTask:
    """The ``sort`` task whose train split feeds SFT in order and whose validation split is evaluated."""
    return SyntheticTask(
        kind="sort",
        levels=list(recipe.levels),
        num_train=recipe.steps * recipe.batch_size,
        num_validation=eval_prompts * len(recipe.levels),
        num_test=0,
        seed=recipe.seed,
    )


def train(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], recipe: Recipe
) -> list[float]:
    """Run the SFT phase in place on consecutive batches of ``examples``; returns every step's loss."""
    size = recipe.batch_size
    batches = (sft_batch(tokenizer, examples[i * size : (i + 1) * size]) for i in range(recipe.steps))
    return optimise(model, batches, recipe.lr)


def optimise(model: PreTrainedModel, batches: Iterable[dict[str, Tensor]], lr: float) -> list[float]:
    """One AdamW step (no weight decay) on each batch in turn, the model left in eval mode; every step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def completions(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], sample: bool
) -> list[str]:
    """Decoded ``generate`` outputs (left padding; greedy, or sampled at temperature 1 as RL samples)."""
    enc = tokenizer([str(ex.prompt) for ex in examples], return_tensors="pt", padding=True)
    mode = {"do_sample": True, "temperature": 1.0, "top_p": 1.0} if sample else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=max(len(ex.answer) for ex in examples) + 1, **mode)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: SyntheticTask, seed: int = 0
) -> dict[str, dict[int, float]]:
    """Success rate per level on the task's validation split, greedy and sampled (seeded)."""
    torch.manual_seed(seed)
    model.eval()
    result: dict[str, dict[int, float]] = {"greedy": {}, "sampled": {}}
    for n in task.levels:
        examples = [ex for ex in task.examples("validation") if ex.difficulty == n]
        for mode, by_level in result.items():
            texts = completions(model, tokenizer, examples, sample=mode == "sampled")
            by_level[n] = round(task.successes(examples, texts).float().mean().item(), 4)
    return result


def warm_start(out: str | Path, recipe: Recipe = Recipe(), eval_prompts: int = 200) -> dict:
    """Build, warm-start, evaluate and save the model at ``out``; returns what ``warmstart.json`` holds."""
    torch.set_num_threads(2)
    start = time.perf_counter()
    task = make_task(recipe, eval_prompts)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        tokenizer,
        hidden_size=recipe.hidden_size,
        num_layers=recipe.num_layers,
        num_heads=recipe.num_heads,
        seed=recipe.seed,
    )
    losses = train(model, tokenizer, task.examples("train"), recipe)
    train_s = time.perf_counter() - start
    acc = evaluate(model, tokenizer, task, recipe.seed) if eval_prompts else {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "task": repr(task),
        "recipe": asdict(recipe),
        "params": sum(p.numel() for p in model.parameters()),
        "losses": [round(x, 4) for x in losses],
        "eval": f"{eval_prompts} validation prompts per level; sampled = temperature 1.0, seed {recipe.seed}",
        "accuracy": acc,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.perf_counter() - start, 2),
    }
    (out / "warmstart.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def recipe_arguments(parser: argparse.ArgumentParser, recipe: type) -> argparse.ArgumentParser:
    """One ``--option`` per field of the dataclass ``recipe`` (its default; tuples take several values)."""
    for f in fields(recipe):
        default = getattr(recipe, f.name)
        if isinstance(default, tuple):
            kind = type(default[0]) if default else int
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, nargs="+", default=list(default))
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    return parser


def recipe_from(recipe: type, values: dict):
    """``recipe(**values)`` with lists as tuples (parsed options, or a saved report's ``recipe``)."""
    return recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def parse_options(
    doc: str, recipe: type, out: Path, eval_prompts: int, argv: Sequence[str] | None, module: str, task: Callable
):
    """A warm start's command line: (``--out``, the parsed ``recipe``, ``--eval-prompts``); bad options (and those
    ``task(recipe, eval_prompts)`` refuses) end it in argparse's error naming the option, before anything trains."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--eval-prompts", type=int, default=eval_prompts)
    args = vars(recipe_arguments(parser, recipe).parse_args(argv))
    out, eval_prompts = args.pop("out"), args.pop("eval_prompts")
    if problem := recipe_problem(args, eval_prompts):  # before anything trains or --out is written
        parser.error(problem)
    parsed = recipe_from(recipe, args)
    try:
        task(parsed, eval_prompts)  # the task's own checks (levels in range, ...)
    except ValueError as err:
        parser.error(str(err))
    return out, parsed, eval_prompts


def recipe_problem(args: dict, eval_prompts: int) -> str | None:
    """What is wrong with a warm start's options, naming the option, or None: counts below 1 (steps, batch, layers,
    heads, hidden size, levels), ``--eval-prompts`` below 0, a hidden size that the heads do not divide into even
    head sizes, a learning rate that is not finite and positive, a tool rate outside [0, 1]."""
    for name in ("steps", "batch_size", "hidden_size", "num_layers", "num_heads", "max_positions"):
        if name in args and args[name] < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {args[name]}"
    if any(level < 1 for level in args.get("levels", ())):
        return f"--levels must be >= 1 each, got {args['levels']}"
    if eval_prompts < 0:
        return f"--eval-prompts must be >= 0 (0: no evaluation), got {eval_prompts}"
    if args["hidden_size"] % (2 * args["num_heads"]):  # rotary embeddings rotate pairs: an even head size
        return f"--hidden-size {args['hidden_size']} must be a multiple of 2 x --num-heads {args['num_heads']}"
    if not (math.isfinite(args["lr"]) and args["lr"] > 0):  # inf trained NaN weights, 0 none: both saved over --out
        return f"--lr must be a finite number > 0, got {args['lr']}"
    if not 0 <= args.get("tool_rate", 0) <= 1:
        return f"--tool-rate must be in [0, 1], got {args['tool_rate']}"
    return None


def print_training(report: dict) -> None:
    """The parameter count, first and last loss and times of a warm start's report."""
    losses = report["losses"]
    print(
        f"params {report['params']:,}  loss {losses[0]:.3f} -> {losses[-1]:.3f}  "
        f"train {report['train_seconds']} s  total {report['total_seconds']} s"
    )


def main(argv: Sequence[str] | None = None) -> None:
    out, recipe, eval_prompts = parse_options(__doc__, Recipe, DEFAULT_OUT, 200, argv, "sgrpo.warmstart", make_task)
    report = warm_start(out, recipe, eval_prompts)
    print_training(report)
    for mode, by_level in report["accuracy"].items():
        print(f"{mode:8s}" + "  ".join(f"n={n}: {a:.3f}" for n, a in by_level.items()))
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
