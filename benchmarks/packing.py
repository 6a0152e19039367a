"""The update's log-prob cost, padded (today's trimmed micro-batches) against packed, on a grid of workloads.

    python benchmarks/packing.py [--quick] [--repeats 3] [--threads 1] [--jobs 2] [--no-publish]

What is timed is what the update runs for each micro-batch of its gradient pass: ``trim``, the layout's
token counts (``layout_tokens``), sgrpo's ``completion_logprobs`` with entropies, and the backward of
the log-probs' sum, over the micro-batches ``sgrpo.train.batching.update_micro_batches`` cuts (the
update's own plan; no row limit; ``micro_batch_tokens`` "auto", 1,024 on CPU, or 8,192, the accelerators').
Three modes per workload:

- ``padded+shared``: ``packing: false``, ``share_prompts: true`` (the trimmed update before packing);
- ``packed``: ``packing: true``, ``share_prompts: false`` (each completion with its own copy of its prompt);
- ``packed+shared``: ``packing: true``, ``share_prompts: true`` (the defaults: each group's prompt once, under a
  block mask, where the cost model says it pays; the micro-batches keep a group's rows together).

The model is a randomly initialised Llama (``MODEL``: hidden 256, 2 layers, vocabulary 2,048, fp32,
SDPA attention) on ``--threads`` CPU threads; 32 rows per workload (32 / G groups), completions capped
at ``CAP`` tokens. The grid (``grid``): completion lengths uniform on [4, cap] or log-uniform on [4, cap]
(most short, a few near the cap), prompts short (16-32 tokens) or long (200-400 tokens, one length per
group), G 4 or 16, micro-batch budget "auto" or 8,192 (16 workloads). Each workload runs every mode once to
warm up, then ``--repeats`` rounds of all three, the modes' order rotating from round to round; a run's figure is
its CPU time (``time.process_time``). ``--jobs`` workloads run at a time, each in a process of its own (on 2 idle
cores, 2 jobs: an estimated 4-5 minutes for the full grid, from its CPU seconds).
Reports each mode's best and median, side by side the speed-ups of ``packed`` and ``packed+shared`` over
each mode (its time over theirs, from the best runs), and each layout's padding fraction (1 - real tokens /
tokens the forward computes). ``--quick`` is a smoke run (a tiny model, four workloads, one round), published
like a full one (the tests publish into a temporary folder). Prints, never asserts; what it prints is published
to ``benchmarks/reports/packing/`` (``benchmarks/artefact.py``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import artefact  # noqa: E402

#: the model of a full run and of ``--quick``
MODEL = {"hidden": 256, "layers": 2, "heads": 4, "vocab": 2048}
QUICK_MODEL = {"hidden": 64, "layers": 1, "heads": 2, "vocab": 256}
#: rows per workload, and the completion cap (of a full run; ``--quick`` uses ``QUICK_CAP``)
ROWS, CAP, QUICK_CAP = 32, 256, 32
PROMPTS = {"short": (16, 32), "long": (200, 400)}
SKEWS = ("uniform", "log-uniform")
GROUPS = (4, 16)
#: ``micro_batch_tokens``: the CPU default ("auto": 1,024) and the accelerators' default (8,192)
BUDGETS = ("auto", 8192)
#: the three modes: (packing, share_prompts)
MODES = {"padded+shared": (False, True), "packed": (True, False), "packed+shared": (True, True)}


def grid(quick: bool) -> list[dict]:
    """The workloads: every budget x skew x prompt x G (``--quick``: short prompts and G 4 only, lengths scaled
    down)."""
    if quick:
        return [{"budget": b, "skew": s, "prompt": "short", "G": 4} for b in BUDGETS for s in SKEWS]
    return [{"budget": b, "skew": s, "prompt": p, "G": g} for b in BUDGETS for s in SKEWS for p in PROMPTS
            for g in GROUPS]  # fmt: skip


def workload(spec: dict, cap: int, vocab: int, seed: int = 0, quick: bool = False):
    """A ``RolloutBatch`` of ``ROWS`` rows: per group a prompt length, per row a completion length (``spec``)."""
    import torch

    from sgrpo.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    groups = ROWS // spec["G"]
    lo, hi = (4, 8) if quick else PROMPTS[spec["prompt"]]
    prompts = torch.randint(lo, hi + 1, (groups,), generator=g).repeat_interleave(spec["G"])  # [N]
    u = torch.rand(ROWS, generator=g)
    if spec["skew"] == "uniform":
        lengths = 4 + (u * (cap - 3)).floor()
    else:
        lengths = torch.exp(math.log(4) + u * (math.log(cap + 1) - math.log(4))).floor()
    lengths = lengths.long().clamp(4, cap)
    p = int(prompts.max())
    ids = torch.randint(3, vocab, (ROWS, p + cap), generator=g)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(ROWS, cap, dtype=torch.bool)
    for i in range(ROWS):
        attn[i, p - prompts[i] : p + lengths[i]] = 1
        mask[i, : lengths[i]] = True
        ids[i, p - prompts[i] : p] = ids[i - i % spec["G"], p - prompts[i] : p]  # one prompt per group
    ids = ids * attn
    return RolloutBatch(ids, attn, mask, [""] * ROWS, torch.zeros(ROWS, dtype=torch.bool), spec["G"])


def computed_tokens(batch: dict, packing: bool, share: bool, real: int, padded: int, ran: int) -> int:
    """Tokens the forward of one trimmed micro-batch computes: packed, its rows x their width (``ran``; the caller
    gives the shared layout's where prompts are shared); padded, rows x
    width, or with shared prompts each distinct prompt once plus every row's completion colums (where
    ``completion_hidden_states`` shares: some prompt repeats, prompt and completion wider than 0 and 1)."""
    import torch

    if packing:
        return ran
    ids, attn, t = batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1]
    n, p = ids.shape[0], ids.shape[1] - t
    if share and p >= 1 and t >= 2:
        distinct = torch.unique(torch.cat([ids[:, :p], attn[:, :p]], 1), dim=0).shape[0]
        if distinct < n:
            return distinct * p + n * (t - 1)
    return padded


def run(model, rollout, mode: str, budget: int | str) -> tuple[float, dict]:
    """One gradient pass's log-probs in ``mode``: CPU seconds and the layout's token counts."""
    import torch

    from sgrpo.model.logprobs import completion_logprobs
    from sgrpo.model.packing import layout_tokens, shared_layout_tokens, shared_pays
    from sgrpo.train.batching import trim, update_micro_batches

    packing, share = MODES[mode]
    model.zero_grad(set_to_none=True)
    hidden = model.config.hidden_size
    counts = {"micro_batches": 0, "real": 0, "computed": 0}
    started = time.process_time()
    rows = torch.arange(rollout.input_ids.shape[0])
    plan = update_micro_batches(rollout, rows, rollout.completion_mask, packing, hidden, None, budget, share=share)
    for chunk in plan:
        batch = trim(rollout, chunk, rollout.completion_mask)
        real, padded, ran = layout_tokens(batch["attention_mask"], batch["mask"], False, hidden)
        if packing and share and shared_pays(batch["attention_mask"], batch["mask"], batch["input_ids"], hidden):
            ran = shared_layout_tokens(batch["input_ids"], batch["attention_mask"], batch["mask"], hidden)[1]
        logp, _ = completion_logprobs(
            model, batch["input_ids"], batch["attention_mask"], batch["mask"], with_entropy=True,
            share_prompts=share, packing=packing,
        )  # fmt: skip
        logp.sum().backward()
        counts["micro_batches"] += 1
        counts["real"] += real
        counts["computed"] += computed_tokens(batch, packing, share, real, padded, ran)
    return time.process_time() - started, counts


def build_model(sizes: dict, cap: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = sizes["hidden"]
    config = LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=h, intermediate_size=4 * h, num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"], max_position_embeddings=1024 + cap,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


_MODELS: dict = {}  # per process: the model of (quick, threads), built once


def measure_workload(spec: dict, quick: bool, threads: int, repeats: int) -> dict:
    """One workload: a warm-up round of every mode, then ``repeats`` rounds (the modes' order rotating); its figures.
    Runs in a worker process (``--jobs``), one thread each, on a model built once per process (same seed)."""
    import torch

    torch.set_num_threads(threads)
    sizes, cap = (QUICK_MODEL, QUICK_CAP) if quick else (MODEL, CAP)
    if (quick, threads) not in _MODELS:
        _MODELS[(quick, threads)] = build_model(sizes, cap)
    model = _MODELS[(quick, threads)]
    rollout = workload(spec, cap, sizes["vocab"], quick=quick)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    counts = {mode: run(model, rollout, mode, spec["budget"])[1] for mode in MODES}  # warm-up round
    order = list(MODES)
    for r in range(repeats):
        for mode in order[r % len(order) :] + order[: r % len(order)]:
            times[mode].append(run(model, rollout, mode, spec["budget"])[0])
    modes = {}
    for mode in MODES:
        c = counts[mode]
        modes[mode] = {**c, "padding_fraction": 1 - c["real"] / c["computed"], "times_s": times[mode],
                       "best_s": min(times[mode]), "median_s": statistics.median(times[mode])}  # fmt: skip
    for mode in MODES:
        modes[mode]["packed_speedup"] = modes[mode]["best_s"] / modes["packed"]["best_s"]
        modes[mode]["shared_speedup"] = modes[mode]["best_s"] / modes["packed+shared"]["best_s"]
    return {**spec, "mean_completion": float(rollout.completion_mask.sum(-1).float().mean()), "modes": modes}


def measure(args: argparse.Namespace) -> dict:
    """Every workload of the grid, the modes side by side, ``--jobs`` workloads at a time (separate processes, one
    thread each: CPU time per process); prints the table in the grid's order, returns the figures."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if args.quick:
        args.repeats = 1
    sizes, cap = (QUICK_MODEL, QUICK_CAP) if args.quick else (MODEL, CAP)
    print(
        f"Random Llama: hidden {sizes['hidden']}, {sizes['layers']} layers, {sizes['heads']} heads, vocabulary "
        f"{sizes['vocab']:,}, fp32, SDPA, {args.threads} thread(s); {ROWS} rows per workload, completions capped at "
        f"{cap}; {args.repeats} measured round(s) after one warm-up round; CPU seconds per gradient pass; "
        f"{args.jobs} workload(s) at a time.\n"
    )
    print("| micro_batch_tokens | skew | prompt | G | mode | micro-batches | padding | best (s) | median (s) | "
          "speed-up of packed | of packed+shared |")  # fmt: skip
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    specs = grid(args.quick)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        jobs = [pool.submit(measure_workload, spec, args.quick, args.threads, args.repeats) for spec in specs]
        workloads = []
        for job in jobs:
            workloads.append(job.result())
            w = workloads[-1]
            for mode, m in w["modes"].items():
                print(f"| {w['budget']} | {w['skew']} | {w['prompt']} | {w['G']} | {mode} | {m['micro_batches']} | "
                      f"{m['padding_fraction']:.2f} | {m['best_s']:.2f} | {m['median_s']:.2f} | "
                      f"{m['packed_speedup']:.2f} | {m['shared_speedup']:.2f} |", flush=True)  # fmt: skip
    return {"model": sizes, "rows": ROWS, "cap": cap, "threads": args.threads, "repeats": args.repeats,
            "jobs": args.jobs, "quick": args.quick, "workloads": workloads}  # fmt: skip


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model, two workloads)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per workload (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--jobs", type=int, default=2, help="workloads measured at a time, each in its own process")
    args = artefact.publish_option(parser).parse_args(argv)
    started = time.perf_counter()
    with artefact.recording() as printed:
        result = measure(args)
        result["wall_s"] = time.perf_counter() - started
        print(f"\nWall time {result['wall_s']:.0f} s.")
    report = "# The update's log-probs: padded against packed\n\n" + printed.getvalue()
    return artefact.publish_run(args, "packing", result, report, __file__, argv)


if __name__ == "__main__":
    main()
