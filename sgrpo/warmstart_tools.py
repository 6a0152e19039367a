"""Warm-start the tool quickstart's model: a tiny char-level chat Llama, briefly supervised on the calculator task.

The model (``sgrpo.model.tiny.build_chat_tokenizer``: printable ASCII, role markers and the ``<tool_call>`` tags
as single tokens, a prefix-preserving chat template that renders the tools as ``add(a,b) mul(a,b)``) is taught
on conversations of ``tasks.calculator.CalculatorTask``: in a share ``tool_rate`` of them, drawn at random
whatever the level, it calls the right tool correctly (``<tool_call>{"name": "mul", "arguments": {"a": 4087,
"b": 7931}}</tool_call>``), reads its output and answers with it; in the others it answers at once. A tiny
model answers short sums and products from its head and long ones wrongly, so after this phase it calls the
tool about as often as it did in the data, at every level: RL has headroom in both reward and tool use.

Every conversation is rendered turn by turn with the tokenizer's chat template, as the multi-turn engine renders
an episode (``sgrpo.rollout.episodes``), and tokenized segment by segment; the loss is on the assistant turns
and their ``<eos>`` only. The report measures the model as RL meets it: episodes of
``tasks.environment.ToolEnvironment([add, mul])`` on the task's validation split, run by ``HFRollout``
(sampled at temperature 1, and greedy): success and tool-use rate per level.

Regenerate the shipped asset (bitwise deterministic from the seed on a given machine)::

    python -m sgrpo.warmstart_tools --out sgrpo/assets/tools_model --seed 0
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sgrpo.model.tiny import build_chat_tokenizer, build_tiny_llama
from sgrpo.rollout.hf import HFRollout
from sgrpo.types import Example, Messages
from sgrpo.warmstart import optimise, padded_batch, parse_options, print_training
from tasks.calculator import TOOLS, CalculatorTask
from tasks.environment import ToolEnvironment
from tasks.tools import tool_schema

DEFAULT_OUT = Path(__file__).parent / "assets" / "tools_model"


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the warm-started weights (with the machine's float arithmetic)."""

    seed: int = 0
    operations: tuple[str, ...] = ("add", "mul")
    levels: tuple[int, ...] = (1, 2, 3)  # digits per operand, balanced in every batch
    tool_rate: float = 0.5  # the share of conversations that call the tool (the rest answer at once)
    steps: int = 900
    batch_size: int = 32
    lr: float = 3e-3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 160


def tool_call(name: str, arguments: dict) -> str:
    """A Hermes / Qwen tool call as the model writes it."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def conversation(example: Example, use_tool: bool) -> Messages:
    """The example's prompt and a correct answer: through its tool (call, output, answer), or at once."""
    opening = [dict(m) for m in example.prompt]
    if not use_tool:
        return [*opening, {"role": "assistant", "content": example.answer}]
    meta = example.metadata
    call = tool_call(meta["operation"], {"a": meta["a"], "b": meta["b"]})
    return [*opening, {"role": "assistant", "content": call}, {"role": "tool", "content": example.answer},
            {"role": "assistant", "content": example.answer}]  # fmt: skip


def sft_row(tokenizer: PreTrainedTokenizerBase, messages: Messages, tools: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of ``messages`` rendered turn by turn, and labels: the assistant turns (with ``<eos>``), -100 elsewhere.

    Each segment is what the chat template adds to the conversation so far, tokenized apart, as the episode
    engine tokenizes an observation: the opening and the observations end with the generation prompt.
    """
    ids, labels, text = [], [], ""
    for k, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        prompt_next = not assistant and (k + 1 == len(messages) or messages[k + 1]["role"] == "assistant")
        rendered = tokenizer.apply_chat_template(
            messages[: k + 1], tokenize=False, add_generation_prompt=prompt_next, tools=tools
        )
        if not rendered.startswith(text):
            raise ValueError("the chat template does not extend a conversation's rendering as it grows")
        segment = tokenizer(rendered[len(text) :], add_special_tokens=False)["input_ids"]
        ids += segment
        labels += segment if assistant else [-100] * len(segment)
        text = rendered
    return ids, labels


def make_task(recipe: Recipe, eval_prompts: int = 100) -> CalculatorTask:
    """The task whose train split feeds SFT in order and whose validation split is evaluated."""
    levels, operations = len(recipe.levels), len(recipe.operations)
    return CalculatorTask(
        operations=list(recipe.operations),
        levels=list(recipe.levels),
        num_train=recipe.steps * recipe.batch_size,
        num_validation=eval_prompts * levels * operations,
        num_test=0,
        seed=recipe.seed,
    )


def batches(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], recipe: Recipe, tools: list[dict]
) -> Iterator[dict[str, Tensor]]:
    """Consecutive batches of ``examples``, each conversation using the tool with probability ``tool_rate``."""
    rng = random.Random(f"tools-warmstart/{recipe.seed}")
    for step in range(recipe.steps):
        chunk = examples[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        rows = [sft_row(tokenizer, conversation(ex, rng.random() < recipe.tool_rate), tools) for ex in chunk]
        yield padded_batch([r for r, _ in rows], [t for _, t in rows], tokenizer.pad_token_id)


def environment(recipe: Recipe, tokenizer: PreTrainedTokenizerBase | None = None) -> ToolEnvironment:
    """The tool environment of the recipe's operations (as ``configs/tools_quickstart.yaml`` configures it)."""
    env = ToolEnvironment([TOOLS[op] for op in recipe.operations], max_turns=3)
    if tokenizer is not None:
        env.adapt_to_tokenizer(tokenizer)
    return env


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: CalculatorTask,
    recipe: Recipe,
    seed: int = 0,
    samples: int = 1,
    modes: Sequence[str] = ("sampled", "greedy"),
) -> dict[str, dict[str, dict[int, float]]]:
    """Success and tool-use rate (episodes with a tool call) per level on the task's validation split, in
    ``samples`` episodes per prompt sampled at temperature 1 (seeded), and greedy (one):
    ``{mode: {"success" | "tool_use": {level: rate}}}``."""
    torch.manual_seed(seed)
    model.eval()
    env, rollout = environment(recipe, tokenizer), HFRollout(max_new_tokens=64)
    result: dict[str, dict[str, dict[int, float]]] = {}
    for mode in modes:
        by_level: dict[str, dict[int, float]] = {"success": {}, "tool_use": {}}
        g = 1 if mode == "greedy" else samples
        for n in task.levels:
            examples = [ex for ex in task.examples("validation") if ex.difficulty == n]
            batch = rollout.generate(model, tokenizer, examples, g, greedy=mode == "greedy", environment=env)
            repeated = [ex for ex in examples for _ in range(g)]
            success = task.successes(repeated, batch.completions).float().mean().item()
            by_level["success"][n] = round(success, 4)
            by_level["tool_use"][n] = round(sum(e.tool_calls > 0 for e in batch.episodes) / len(repeated), 4)
        result[mode] = by_level
    return result


def warm_start(out: str | Path, recipe: Recipe = Recipe(), eval_prompts: int = 20) -> dict:
    """Build, warm-start, evaluate and save the model at ``out``; returns what ``warmstart.json`` holds."""
    torch.set_num_threads(1)  # one thread: the same sums on any machine, and fastest on a shared one
    start = time.perf_counter()
    task = make_task(recipe, eval_prompts)
    tokenizer = build_chat_tokenizer()
    model = build_tiny_llama(
        tokenizer,
        hidden_size=recipe.hidden_size,
        num_layers=recipe.num_layers,
        num_heads=recipe.num_heads,
        max_positions=recipe.max_positions,
        seed=recipe.seed,
    )
    tools = environment(recipe).schemas
    losses = optimise(model, batches(tokenizer, task.examples("train"), recipe, tools), recipe.lr)
    train_s = time.perf_counter() - start
    result = evaluate(model, tokenizer, task, recipe, recipe.seed) if eval_prompts else {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "task": repr(task),
        "recipe": asdict(recipe),
        "tools": [tool_schema(TOOLS[op]) for op in recipe.operations],
        "params": sum(p.numel() for p in model.parameters()),
        "losses": [round(x, 4) for x in losses],
        "eval": f"{eval_prompts} validation prompts per level and operation, one episode each (ToolEnvironment, "
        f"max_turns 3, 64 new tokens a turn); sampled = temperature 1.0, seed {recipe.seed}",
        "episodes": result,
        "train_seconds": round(train_s, 2),
        "total_seconds": round(time.perf_counter() - start, 2),
    }
    (out / "warmstart.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    module, options = "sgrpo.warmstart_tools", (__doc__, Recipe, DEFAULT_OUT, 20, argv)
    out, recipe, eval_prompts = parse_options(*options, module, make_task)
    report = warm_start(out, recipe, eval_prompts)
    print_training(report)
    for mode, by_level in report["episodes"].items():
        for name, rates in by_level.items():
            print(f"{mode:8s} {name:9s}" + "  ".join(f"n={n}: {a:.3f}" for n, a in rates.items()))
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
