"""``python -m sgrpo.eval.alpaca``: an exported model's AlpacaEval 2.0 outputs, as the SoftmaxGRPO authors make them.

One greedy answer per instruction of AlpacaEval's own file (``alpaca_eval.json`` of the hub set
``tatsu-lab/alpaca_eval``: a JSON list of ``instruction``, ``output``, ``generator``, ``dataset``), prompted as
the system message ``SYSTEM_PROMPT`` and the instruction through the model's chat template, at most
``--max-new-tokens`` new tokens (the authors: 6,144, context 16,384; a prompt that does not fit is refused, never
cut); the output is the completion's final text (``tasks.final_text``: after the last ``</think>``, end-of-turn
markers removed). Written as the JSON list ``alpaca_eval --model_outputs`` reads: ``instruction``, ``output``,
``generator`` (``--generator``) and ``dataset`` (the instruction's), in the instructions' order.

    python -m sgrpo.eval.alpaca --model runs/paper/openthoughts/hf_model --instructions data/alpaca_eval.json \\
        --output runs/paper/transfer/alpaca_outputs.json

The authors generate with vLLM in bfloat16; this command runs transformers' greedy ``generate`` (``--dtype``,
``--device``), batch by batch: the same decoding rule, whose bf16 kernels may break near-ties differently.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sgrpo.checks import ConfigError, exit_with_error

#: the authors' AlpacaEval system message (their evaluate.py; shorter than OpenThoughts' training one)
SYSTEM_PROMPT = (
    "You are a helpful assistant. Put your reasoning in <think> </think> tags, followed by your final answer."
)


def read_instructions(path: Path) -> list[dict]:
    """AlpacaEval's instructions: a JSON list of objects, each with a non-empty ``instruction``."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--instructions {path}: not a readable JSON list ({err})") from None
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"--instructions {path}: expected a non-empty JSON list of {{instruction, ...}} objects")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not str(row.get("instruction") or "").strip():
            raise ConfigError(f"--instructions {path}, row {number}: no 'instruction' text")
    return rows


def generate(model, tokenizer, rows: list[dict], max_new_tokens: int, max_model_len: int, generator: str,
             batch_size: int = 8) -> list[dict]:  # fmt: skip
    """The output records of ``rows`` (module docstring), greedy, ``batch_size`` prompts at a time."""
    import torch

    from sgrpo.rollout.engine import render_prompt
    from tasks.similarity import final_text

    texts = [render_prompt(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": row["instruction"]}]) for row in rows]  # fmt: skip
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(rows)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens > max_model_len:
        raise ConfigError(f"instruction {longest + 1} has {lengths[longest]} prompt tokens: with --max-new-tokens "
                          f"{max_new_tokens} it passes --max-model-len {max_model_len}; raise "
                          f"--max-model-len")  # fmt: skip
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for start in range(0, len(rows), batch_size):
        batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(model.device)  # fmt: skip
        with torch.no_grad():
            ids = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        completions = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for row, completion in zip(rows[start : start + batch_size], completions, strict=True):
            record = {"instruction": row["instruction"], "output": final_text(completion), "generator": generator}
            out.append(record | {"dataset": row.get("dataset", "")})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sgrpo.eval.alpaca", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an exported model folder (python -m sgrpo.export)")
    parser.add_argument("--instructions", type=Path, required=True, help="AlpacaEval's alpaca_eval.json")
    parser.add_argument("--output", type=Path, required=True, help="the outputs file alpaca_eval reads")
    parser.add_argument("--max-new-tokens", type=int, default=6144, help="the authors' 6,144")
    parser.add_argument("--max-model-len", type=int, default=16384, help="prompt + new tokens, at most (16,384)")
    parser.add_argument("--generator", default="sgrpo", help="the outputs' generator name")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)
    try:
        rows = read_instructions(args.instructions)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
        records = generate(model.eval(), tokenizer, rows, args.max_new_tokens, args.max_model_len, args.generator,
                           args.batch_size)  # fmt: skip
    except ConfigError as err:
        exit_with_error(str(err), 2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
    print(f"{len(records)} outputs -> {args.output}")
    return records


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
