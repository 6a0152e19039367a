"""The update's log-prob cost, padded (today's trimmed micro-batches) against packed, on a grid of workloads.

    python benchmarks/packing.py [--quick] [--repeats 3] [--threads 1] [--jobs 2] [--no-publish]
    python benchmarks/packing.py --device cuda [--repeats 3]     # on one GPU: GPU_MODEL in bf16-mixed

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

``--device cuda`` runs the same grid on one GPU as the trainer's update runs there: a 0.4B model (``GPU_MODEL``) in
bf16-mixed (float32 weights, bf16 autocast), the packed modes on the attention ``choose_attention`` gives the trainer
(flash-attention's varlen kernel where installed, else flex attention), the padded mode on SDPA, budgets "auto"
(8,192 on accelerators) and one pass (``GPU_BUDGETS``), one workload at a time. A run's figure is then its wall time
(the GPU synchronised), and each mode also reports its first pass (compiles included), the graphs torch.compile built
during the measured rounds (0: no recompile once warm), its peak GPU memory and its share of the bf16 matmul peak
(6 x the body's parameters per real token). Published to ``benchmarks/reports/packing_cuda/``. ``--precision
bf16-mixed`` takes the GPU's arithmetic on a CPU too (a dry run of that path).
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
#: ``--device cuda``: the model (the 0.44B body of ``benchmarks/throughput.py``'s GPU workload) and the budgets
GPU_MODEL = {"hidden": 1024, "layers": 24, "heads": 16, "vocab": 2048}
GPU_BUDGETS = ("auto", 65536)
#: the three modes: (packing, share_prompts)
MODES = {"padded+shared": (False, True), "packed": (True, False), "packed+shared": (True, True)}


def grid(quick: bool, budgets: tuple = BUDGETS) -> list[dict]:
    """The workloads: every budget x skew x prompt x G (``--quick``: short prompts and G 4 only, lengths scaled
    down)."""
    if quick:
        return [{"budget": b, "skew": s, "prompt": "short", "G": 4} for b in budgets for s in SKEWS]
    return [{"budget": b, "skew": s, "prompt": p, "G": g} for b in budgets for s in SKEWS for p in PROMPTS
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


def run(model, rollout, mode: str, budget: int | str, bf16: bool = False) -> tuple[float, dict]:
    """One gradient pass's log-probs in ``mode``: its seconds (CPU seconds on a CPU, wall seconds with the GPU
    synchronised on a GPU) and the layout's token counts (on a GPU also its peak memory, ``peak_gib``). ``bf16``:
    under bf16 autocast, as the trainer's bf16-mixed."""
    import contextlib

    import torch

    from sgrpo.model.logprobs import completion_logprobs
    from sgrpo.model.packed_path import choose_attention
    from sgrpo.model.packing import layout_tokens, shared_layout_tokens, shared_pays, sharing_problem
    from sgrpo.train.batching import trim, update_micro_batches

    packing, share = MODES[mode]
    device = rollout.input_ids.device
    model.zero_grad(set_to_none=True)
    hidden = model.config.hidden_size
    counts = {"micro_batches": 0, "real": 0, "computed": 0}
    cast = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    with cast:  # the attention the trainer's update runs in this mode (choose_attention reads autocast's dtype)
        model.set_attn_implementation("sdpa")
        if packing:
            counts["attention"] = choose_attention(model, device.type)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter() if cuda else time.process_time()
    rows = torch.arange(rollout.input_ids.shape[0], device=device)
    plan = update_micro_batches(rollout, rows, rollout.completion_mask, packing, hidden, None, budget, share=share)
    for chunk in plan:
        batch = trim(rollout, chunk, rollout.completion_mask)
        real, padded, ran = layout_tokens(batch["attention_mask"], batch["mask"], False, hidden)
        shares = packing and share and sharing_problem(model) is None  # flash-attention's varlen kernel: unshared
        if shares and shared_pays(batch["attention_mask"], batch["mask"], batch["input_ids"], hidden):
            ran = shared_layout_tokens(batch["input_ids"], batch["attention_mask"], batch["mask"], hidden)[1]
        with cast:
            logp, _ = completion_logprobs(
                model, batch["input_ids"], batch["attention_mask"], batch["mask"], with_entropy=True,
                share_prompts=share, packing=packing,
            )  # fmt: skip
        logp.sum().backward()
        counts["micro_batches"] += 1
        counts["real"] += real
        counts["computed"] += computed_tokens(batch, packing, share, real, padded, ran)
    if cuda:
        torch.cuda.synchronize()
        counts["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return (time.perf_counter() if cuda else time.process_time()) - started, counts


def build_model(sizes: dict, cap: int, device: str = "cpu"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = sizes["hidden"]
    config = LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=h, intermediate_size=4 * h, num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"], max_position_embeddings=1024 + cap,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device(device):  # initialised where it runs (a 0.4B model's CPU initialisation takes a while)
        return LlamaForCausalLM(config).train()


_MODELS: dict = {}  # per process: the model of (sizes, threads, device), built once


def sizes_of(quick: bool, device: str) -> tuple[dict, int]:
    """The model's sizes and the completion cap: ``QUICK_MODEL`` for ``--quick``, else ``GPU_MODEL`` on a GPU and
    ``MODEL`` on a CPU."""
    return (QUICK_MODEL, QUICK_CAP) if quick else (GPU_MODEL if device == "cuda" else MODEL, CAP)


def measure_workload(spec: dict, quick: bool, threads: int, repeats: int, device: str = "cpu",
                     bf16: bool = False, peak_flop_s: float | None = None) -> dict:  # fmt: skip
    """One workload: a warm-up round of every mode, then ``repeats`` rounds (the modes' order rotating); its figures.
    Runs in a worker process (``--jobs``), ``threads`` threads each, on a model built once per process (same seed).
    ``peak_flop_s``: the device's matmul peak, for each mode's share of it (``flop_share``)."""
    import dataclasses

    import torch
    from torch._dynamo.utils import counters

    torch.set_num_threads(threads)
    sizes, cap = sizes_of(quick, device)
    key = (tuple(sizes.items()), threads, device)
    if key not in _MODELS:
        _MODELS[key] = build_model(sizes, cap, device)
    model = _MODELS[key]
    cpu = workload(spec, cap, sizes["vocab"], quick=quick)
    rollout = dataclasses.replace(cpu, **{f: getattr(cpu, f).to(device) for f in ("input_ids", "attention_mask",
                                                                                   "completion_mask", "truncated")})
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    warm = {mode: run(model, rollout, mode, spec["budget"], bf16) for mode in MODES}  # warm-up round
    counts = {mode: c for mode, (_, c) in warm.items()}
    graphs = counters["stats"]["unique_graphs"]  # torch.compile's graphs so far (flex attention compiles)
    order = list(MODES)
    for r in range(repeats):
        for mode in order[r % len(order) :] + order[: r % len(order)]:
            times[mode].append(run(model, rollout, mode, spec["budget"], bf16)[0])
    body = sum(p.numel() for p in model.parameters()) - 2 * sizes["vocab"] * sizes["hidden"]  # embedding and head
    modes = {}
    for mode in MODES:
        c = counts[mode]
        modes[mode] = {**c, "padding_fraction": 1 - c["real"] / c["computed"], "times_s": times[mode],
                       "best_s": min(times[mode]), "median_s": statistics.median(times[mode]),
                       "first_s": warm[mode][0]}  # fmt: skip
        if peak_flop_s:
            modes[mode]["flop_share"] = 6 * body * c["real"] / modes[mode]["best_s"] / peak_flop_s
    for mode in MODES:
        modes[mode]["packed_speedup"] = modes[mode]["best_s"] / modes["packed"]["best_s"]
        modes[mode]["shared_speedup"] = modes[mode]["best_s"] / modes["packed+shared"]["best_s"]
    return {**spec, "mean_completion": float(cpu.completion_mask.sum(-1).float().mean()), "modes": modes,
            "graphs_compiled_measured": counters["stats"]["unique_graphs"] - graphs}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """Every workload of the grid, the modes side by side, ``--jobs`` workloads at a time (separate processes, one
    thread each: CPU time per process); prints the table in the grid's order, returns the figures."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if args.quick:
        args.repeats = 1
    cuda = args.device == "cuda"
    bf16 = (args.precision or ("bf16-mixed" if cuda else "32-true")) == "bf16-mixed"
    peak = None
    if cuda:
        import torch

        from benchmarks._alternating import matmul_peak

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU here (run without --device for the CPU grid)")
        args.jobs = 1  # one GPU: one workload at a time
        peak = matmul_peak(1, device="cuda")  # bf16, 8192^3
    sizes, cap = sizes_of(args.quick, args.device)
    arithmetic = "bf16-mixed" if bf16 else "fp32"
    where = f"one GPU, {arithmetic}, wall seconds" if cuda else f"{args.threads} thread(s), {arithmetic}, CPU seconds"
    print(
        f"Random Llama: hidden {sizes['hidden']}, {sizes['layers']} layers, {sizes['heads']} heads, vocabulary "
        f"{sizes['vocab']:,}, SDPA (padded) and the trainer's packed attention; {where} per gradient pass; {ROWS} "
        f"rows per workload, completions capped at {cap}; {args.repeats} measured round(s) after one warm-up round; "
        f"{args.jobs} workload(s) at a time." + (f" bf16 matmul peak {peak / 1e12:.0f} TFLOP/s." if cuda else "") + "\n"
    )
    gpu = " first pass (s) | peak GiB | share of peak | attention |" if cuda else ""
    print("| micro_batch_tokens | skew | prompt | G | mode | micro-batches | padding | best (s) | median (s) | "
          f"speed-up of packed | of packed+shared |{gpu}")  # fmt: skip
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---|" if cuda else ""))
    specs = grid(args.quick, GPU_BUDGETS if cuda else BUDGETS)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        jobs = [pool.submit(measure_workload, spec, args.quick, args.threads, args.repeats, args.device, bf16, peak)
                for spec in specs]  # fmt: skip
        workloads = []
        for job in jobs:
            workloads.append(job.result())
            w = workloads[-1]
            for mode, m in w["modes"].items():
                extra = (f" {m['first_s']:.2f} | {m['peak_gib']:.1f} | {m['flop_share']:.1%} | "
                         f"{m.get('attention', 'sdpa')} |") if cuda else ""  # fmt: skip
                print(f"| {w['budget']} | {w['skew']} | {w['prompt']} | {w['G']} | {mode} | {m['micro_batches']} | "
                      f"{m['padding_fraction']:.2f} | {m['best_s']:.2f} | {m['median_s']:.2f} | "
                      f"{m['packed_speedup']:.2f} | {m['shared_speedup']:.2f} |{extra}", flush=True)  # fmt: skip
            if w["graphs_compiled_measured"]:
                print(f"(torch.compile built {w['graphs_compiled_measured']} graph(s) during this workload's measured "
                      "rounds: recompiles after the warm-up)", flush=True)  # fmt: skip
    return {"model": sizes, "rows": ROWS, "cap": cap, "threads": args.threads, "repeats": args.repeats,
            "jobs": args.jobs, "quick": args.quick, "device": args.device, "precision": arithmetic,
            "matmul_peak_flop_s": peak, "workloads": workloads}  # fmt: skip


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model, two workloads)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per workload (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--jobs", type=int, default=2, help="workloads measured at a time, each in its own process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU_MODEL on one GPU in bf16-mixed, wall time (published as packing_cuda)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default=None,
                        help="the arithmetic (default: 32-true on a CPU, bf16-mixed on a GPU)")
    args = artefact.publish_option(parser).parse_args(argv)
    started = time.perf_counter()
    with artefact.recording() as printed:
        result = measure(args)
        result["wall_s"] = time.perf_counter() - started
        print(f"\nWall time {result['wall_s']:.0f} s.")
    report = "# The update's log-probs: padded against packed\n\n" + printed.getvalue()
    name = "packing_cuda" if args.device == "cuda" else "packing" if args.precision in (None, "32-true") else None
    if name is None:  # the CPU in bf16: a dry run of the GPU's arithmetic, not the committed CPU figures
        return None
    return artefact.publish_run(args, name, result, report, __file__, argv)


if __name__ == "__main__":
    main()
