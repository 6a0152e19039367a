"""Peak memory of completion log-probs (forward + backward) at a large vocabulary: chunked vs full logits.

    python benchmarks/logprob_memory.py [--vocab 151936] [--rows 8] [--tokens 512] [--chunk 1024]

Each path runs in a fresh process; the figure is the growth of its peak RSS over the model and inputs
(ru_maxrss). The chunked path is sgrpo's ``completion_logprobs``; the reference materialises
``[N, T, vocab]`` logits and a log-softmax the way a plain implementation does. Prints, never asserts;
what it prints is published to ``benchmarks/reports/logprob_memory/`` (``benchmarks/artefact.py``;
``--no-publish`` skips it), each path's peak growth and time as its ``result``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import artefact  # noqa: E402


def measure(path: str, vocab: int, rows: int, tokens: int, chunk: int | None) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgrpo.model.logprobs import completion_logprobs, position_ids_from_mask

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=tokens + 8,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (rows, tokens + 1))
    attn = torch.ones_like(ids)
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    started = time.perf_counter()
    if path == "chunked":
        logp, _ = completion_logprobs(model, ids, attn, mask, chunk_size=chunk)
    else:
        logits = model(
            input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=position_ids_from_mask(attn[:, :-1])
        ).logits.float()  # [N, T, V]
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp.sum().backward()
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_growth_mib": peak - base, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: sgrpo's 128 MiB of logits)")
    parser.add_argument("--worker", choices=["chunked", "full"], help=argparse.SUPPRESS)
    args = artefact.publish_option(parser).parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.vocab, args.rows, args.tokens, args.chunk)))
        return
    with artefact.recording() as printed:
        results = compare(args)
    report = "# Log-prob memory: chunked against full logits\n\n" + printed.getvalue()
    artefact.publish_run(args, "logprob_memory", results, report, __file__)


def compare(args: argparse.Namespace) -> dict:
    """Run both paths in fresh processes, print the table; return each path's figures and their ratio."""
    results = {}
    for path in ("chunked", "full"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            path,
            f"--vocab={args.vocab}",
            f"--rows={args.rows}",
            f"--tokens={args.tokens}",
        ] + ([f"--chunk={args.chunk}"] if args.chunk else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            results[path] = None
            print(f"{path}: failed ({done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode})")
        else:
            results[path] = json.loads(done.stdout.strip().splitlines()[-1])
    full_logits_mib = args.rows * args.tokens * args.vocab * 4 / 2**20
    print(
        f"log-probs + backward, vocab {args.vocab:,}, {args.rows} x {args.tokens} tokens "
        f"(one fp32 [N, T, V] tensor = {full_logits_mib:,.0f} MiB)"
    )
    print("| path | peak RSS growth (MiB) | time (s) |\n|---|---|---|")
    for path, r in results.items():
        if r:
            print(f"| {path} | {r['peak_growth_mib']:,.0f} | {r['seconds']:.2f} |")
    if results.get("chunked") and results.get("full"):
        results["ratio"] = results["chunked"]["peak_growth_mib"] / results["full"]["peak_growth_mib"]
        print(f"ratio chunked / full: {results['ratio']:.3f}")
    return results


if __name__ == "__main__":
    main()
