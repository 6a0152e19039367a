"""sgrpo vs TRL's GRPOTrainer on one identical CPU workload: step time, tokens/s, peak RSS, FLOP use.

    python benchmarks/throughput.py                      # 10M-parameter Llama, 8 prompts x 8 completions x 32 tokens
    python benchmarks/throughput.py --case large_vocab   # vocab 151,936: peak RSS of one 16 x 512-token step
    python benchmarks/throughput.py --case profile       # where sgrpo's step time goes (phases + top torch ops)
    python benchmarks/throughput.py --case ablation      # sgrpo with each optimisation undone in turn
    python benchmarks/throughput.py --malloc-mmap-threshold 262144  # peak RSS as memory in use (see below)
    python benchmarks/throughput.py --device cuda --prompts 16 --group-size 8 --new-tokens 256 --force-length \
        --hidden 1024 --layers 24 --heads 16 --intermediate 4096   # one GPU, bf16-mixed: the 0.44B workload

Workload (both frameworks, built once here and loaded from the same folder): a randomly initialised
Llama on the character tokenizer of ``sgrpo.model.tiny`` (N parameters printed), the synthetic sort task
restricted to B prompts (every step trains on all of them), G completions each, up to T new tokens
(EOS ends a row, as in training; ``--force-length`` makes every completion T tokens on both sides,
sgrpo's by an EOS id out of the vocabulary's reach (its training rollout refuses ``min_new_tokens``,
which truncates the distribution), TRL's through ``generation_kwargs``, so both do exactly the same
work; the mean length each side got is printed), sampling at temperature 1 (no top-k/top-p),
a binary reward with variance (the parity of the first character's code point: a random model never
sorts, and under exact match every group would be constant, so sgrpo would rightly skip the whole
update; the same ``Reward`` object scores both sides), GRPO z-score advantages, DAPO token-mean
loss, clip 0.2, KL 0 (no reference model), one optimiser step per rollout (AdamW, lr 1e-6, no weight
decay, grad-norm clip 1; the fused implementation on both sides: TRL's default ``adamw_torch_fused``,
sgrpo's ``torch.optim.AdamW(fused=True)``), fp32, no logger, no progress bar, no checkpoints,
``torch.set_num_threads(threads)`` in both. TRL's gradient checkpointing (on by default in TRL) is
off, as in sgrpo, unless ``--trl-gradient-checkpointing``; ``--micro-batch M`` splits the update into
M-row micro-batches on both sides. sgrpo runs with its defaults: the lean decoder
(``--sgrpo-decoder generate`` for transformers' ``generate``) and packed micro-batches (``model.packing``:
each micro-batch's real tokens only, in bins balanced by cost under ``micro_batch_tokens="auto"``, 1,024 on
CPU; ``--sgrpo-micro-batch-tokens``, which also sets most of sgrpo's peak RSS: one micro-batch's
activations); TRL has no counterpart of either knob.

Fairness: each framework runs in its own process (so peak RSS, from ``ru_maxrss``, is its own),
and the parent releases their steps alternately, A B A B ..., one at a time: a worker blocks at the
start of each step (a Lightning ``on_train_batch_start`` / a ``TrainerCallback.on_step_begin``) until
released, so the two never compete for the cores and slow drifts of a shared machine hit both
alike. A step's time runs from its release to the next step start, so everything each framework
does between steps (data loading, logging hooks, optimiser and scheduler) counts. Rollout time is
the time inside ``model.generate`` (wrapped the same way on both sides); the update time is the rest
of the step (reward, log-probs, backward, optimiser, framework overhead). Medians over the measured
steps after ``--warmup`` steps; the best step and the process CPU time per step are printed too,
since a busy machine stretches wall times (``OMP_WAIT_POLICY=PASSIVE`` in the environment, inherited
by both workers, makes them much less sensitive to other load).

Peak RSS on CPU is the memory in use plus what glibc's malloc keeps: a freed block below its mmap threshold stays
in the process's heap, and the threshold rises to the largest block freed (up to 32 MiB), so after the first step
most activations come from the heap, whose free pieces the next step's blocks fit only in part; a framework's
peak then varies from step to step and grows over a long run. ``--malloc-mmap-threshold BYTES`` fixes the
threshold in both workers: every block above it is mapped afresh and given back when freed, so the peak is the
memory in use, and every step is slower (the page faults of mapping them afresh).

FLOP limit: 2N FLOPs per generated token plus 6N per trained (completion) token, against the fp32
matmul peak measured here with the same thread count (a 2048^3 matmul, best of several, before and
after the runs). ``--device cuda``: one GPU, both frameworks in bf16-mixed (fp32 master weights,
TRL's ``bf16=True``), peak memory the GPU's ``max_memory_allocated``, the limit a bf16 8192^3 matmul's
rate (``--sgrpo-cuda-graphs`` turns on sgrpo's CUDA-graph decode steps).
 The large-vocabulary case runs one full step per framework (B=2 prompts x G=8 = 16
rows, 512 new tokens with EOS masked, a binary reward on the first character since the random model
never matches), one process at a time, under a memory cap (killed above it: reported as OOM).
Prints tables; never asserts. What a case prints is published to ``benchmarks/reports/throughput[_CASE][_forced]
[_cuda][_mmap]/`` (``benchmarks/artefact.py``; ``--no-publish`` skips it), with the case's figures as its ``result``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# The repository root on the path, and this folder off it (benchmarks/estimators.py would shadow the package).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks import artefact  # noqa: E402
from benchmarks._alternating import ROWS, build_model, matmul_peak, print_table, run_alternating, summarise  # noqa: E402
from benchmarks._workload import Workload, worker_main  # noqa: E402
from benchmarks._workload_profile import profile_sgrpo  # noqa: E402

FRAMEWORKS = ("sgrpo", "trl")


def case_throughput(args, tmp: Path) -> dict:
    positions = max(256, args.new_tokens + 64)  # prompt + completion within the model's positions
    n, vocab = build_model(tmp, None, args.hidden, args.layers, args.heads, args.intermediate, positions)
    peak_before = matmul_peak(args.threads, device=args.device)
    work = throughput_workload(args, tmp)
    results = dict(zip(FRAMEWORKS, run_alternating([(f, work) for f in FRAMEWORKS], args.warmup, args.mem_cap_gib)))
    peak = max(peak_before, matmul_peak(args.threads, device=args.device))
    where = "one GPU, bf16-mixed" if args.device == "cuda" else f"fp32, {args.threads} threads"
    print(
        f"\n## Throughput: Llama N = {n:,} parameters (hidden {args.hidden}, {args.layers} layers, vocab {vocab}), "
        f"{args.prompts} prompts x {args.group_size} completions x {args.new_tokens} new tokens"
        f"{' (forced)' if work.force_length else ' (EOS allowed)'}, {where}"
    )
    kind = "bf16" if args.device == "cuda" else "fp32"
    print(
        f"{kind} matmul peak {peak / 1e9:.0f} GFLOP/s; {args.warmup} warm-up + {args.steps} measured steps each, "
        f"alternating; micro-batch {args.micro_batch or 'none'}; TRL gradient checkpointing "
        f"{'on' if args.trl_gradient_checkpointing else 'off'}; {allocator(args)}\n"
    )
    summaries = {f: summarise(results[f], n, peak, work.rows) for f in FRAMEWORKS}
    values = {label: tuple(summaries[f] and summaries[f][key] for f in FRAMEWORKS) for label, key, _ in ROWS}
    print_table(values, {label: fmt for label, _, fmt in ROWS})
    for f in FRAMEWORKS:
        if results[f]["error"]:
            print(f"{f}: {results[f]['error']}")
        if summaries[f]:
            times = ", ".join(f"{s['wall_s']:.2f}" for s in results[f]["steps"])
            print(f"{f} step times (s): {times}")
    for f in FRAMEWORKS:  # every measured step's time, as printed above (the docs quote their range)
        if summaries[f]:
            summaries[f]["step_times_s"] = [round(s["wall_s"], 2) for s in results[f]["steps"]]
    return {"parameters": n, "matmul_peak_flop_s": peak, **summaries, "warmup_steps": args.warmup,
            "measured_steps": args.steps,
            "ratio": {key: values[label][0] / values[label][1] for label, key, _ in ROWS
                      if None not in values[label] and values[label][1]}}  # fmt: skip


ABLATIONS = (  # (label, the sgrpo workload fields that undo one optimisation)
    ("sgrpo as configured", {}),
    ("decoder: transformers generate", {"sgrpo_decoder": "generate"}),
    ("no packing (padded micro-batches)", {"packing": False}),
    ("no packing, prompts not shared", {"packing": False, "share_prompts": False}),
    ("no token-budget micro-batches", {"micro_batch_tokens": None}),
    ("MLP keeps its four activations (lean_mlp off)", {"lean_mlp": False}),
    ("norms keep their normalised input (lean_norm off)", {"lean_norm": False}),
    ("none of these", {"sgrpo_decoder": "generate", "micro_batch_tokens": None, "packing": False,
                       "share_prompts": False, "lean_mlp": False, "lean_norm": False}),
)


def case_ablation(args, tmp: Path) -> dict:
    """sgrpo alone, with one optimisation undone per variant, all variants' steps alternating."""
    import dataclasses

    positions = max(256, args.new_tokens + 64)  # prompt + completion within the model's positions
    n, vocab = build_model(tmp, None, args.hidden, args.layers, args.heads, args.intermediate, positions)
    peak = matmul_peak(args.threads)
    base = throughput_workload(args, tmp)
    entries = [("sgrpo", dataclasses.replace(base, **changes)) for _, changes in ABLATIONS]
    results = run_alternating(entries, args.warmup, args.mem_cap_gib)
    print(
        f"\n## What each optimisation buys: sgrpo variants, N = {n:,}, {args.prompts} x {args.group_size} x "
        f"{args.new_tokens} tokens{' (forced)' if base.force_length else ' (EOS allowed)'}, {args.threads} threads, "
        f"{args.warmup} warm-up + {args.steps} measured steps each, alternating; {allocator(args)}\n"
    )
    print("| variant | step (s) | vs configured | rollout (s) | update (s) | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    first, out = None, {}
    for (label, _), result in zip(ABLATIONS, results):
        summary = summarise(result, n, peak, base.rows)
        if summary is None:
            print(f"| {label} | failed: {result['error']} | | | | |")
            continue
        first = first or summary
        out[label] = summary | {"vs_configured": summary["step_s"] / first["step_s"]}
        print(
            f"| {label} | {summary['step_s']:.3f} | {summary['step_s'] / first['step_s']:.2f}x | "
            f"{summary['rollout_s']:.3f} | {summary['update_s']:.3f} | {summary['peak_mib']:,.0f} |"
        )
    return out


def allocator(args) -> str:
    """The workers' allocator setting, as the report states it."""
    if args.malloc_mmap_threshold is None:
        return "glibc's malloc as it comes (its mmap threshold rises to the largest block freed)"
    return (
        f"glibc's mmap threshold fixed at {args.malloc_mmap_threshold:,} bytes in both workers (freed blocks above it "
        "return to the OS at once: the peak RSS is memory in use)"
    )


def throughput_workload(args, tmp: Path) -> Workload:
    return Workload(
        model_dir=str(tmp),
        prompts=args.prompts,
        group_size=args.group_size,
        new_tokens=args.new_tokens,
        force_length=args.force_length,
        sgrpo_decoder=args.sgrpo_decoder,
        sgrpo_cuda_graphs=args.sgrpo_cuda_graphs,
        device=args.device,
        micro_batch_tokens=args.sgrpo_micro_batch_tokens or None,
        steps=args.warmup + args.steps,
        threads=args.threads,
        trl_gradient_checkpointing=args.trl_gradient_checkpointing,
        micro_batch=args.micro_batch,
    )


def case_large_vocab(args, tmp: Path) -> dict:
    positions = 64 + args.large_tokens
    n, vocab = build_model(
        tmp, args.large_vocab, args.large_hidden, args.large_layers, 4, 2 * args.large_hidden, positions
    )
    rows = args.large_rows
    work = Workload(
        model_dir=str(tmp),
        prompts=rows // args.group_size,
        group_size=args.group_size,
        new_tokens=args.large_tokens,
        force_length=True,
        steps=1,
        threads=args.threads,
        logits_chunk_mib=args.sgrpo_chunk_mib,
        micro_batch_tokens=None,  # all rows in one micro-batch, as TRL: the ratio is the LM head's doing
        trl_gradient_checkpointing=args.trl_gradient_checkpointing,
        micro_batch=args.micro_batch,
    )
    results = {f: run_alternating([(f, work)], 0, args.mem_cap_gib)[0] for f in FRAMEWORKS}  # one at a time
    full = rows * args.large_tokens * vocab * 4 / 2**20
    print(
        f"\n## Large vocabulary: vocab {vocab:,}, hidden {args.large_hidden}, {args.large_layers} layers "
        f"(N = {n:,}), one step of {rows} x {args.large_tokens} new tokens (generation included), fp32, "
        f"{args.threads} threads"
    )
    print(
        f"one fp32 [rows, T, vocab] logits tensor would be {full:,.0f} MiB; sgrpo logits_chunk_mib "
        f"{args.sgrpo_chunk_mib:g}; TRL gradient checkpointing {'on' if args.trl_gradient_checkpointing else 'off'}; "
        f"memory cap {args.mem_cap_gib:g} GiB\n"
    )
    step = {f: results[f]["steps"][0] if results[f]["steps"] else None for f in FRAMEWORKS}
    setup = {f: results[f]["setup"] for f in FRAMEWORKS}
    pick = lambda fn: tuple(fn(f) if step[f] and setup[f] else None for f in FRAMEWORKS)  # noqa: E731
    values = {
            "peak RSS (MiB)": pick(lambda f: step[f]["peak_mib"]),
            "RSS after setup (MiB)": pick(lambda f: setup[f]["rss_mib"]),
            "peak RSS - RSS after setup (MiB)": pick(lambda f: step[f]["peak_mib"] - setup[f]["rss_mib"]),
            "step time (s)": pick(lambda f: step[f]["wall_s"]),
            "generate time (s)": pick(lambda f: step[f]["gen_s"]),
            "step time without generate (s)": pick(lambda f: step[f]["wall_s"] - step[f]["gen_s"]),
    }
    mib = "{:,.0f}"
    print_table(values, {"peak RSS (MiB)": mib, "RSS after setup (MiB)": mib, "peak RSS - RSS after setup (MiB)": mib})
    for f in FRAMEWORKS:
        if results[f]["error"]:
            print(f"{f}: {results[f]['error']}")
    return {"parameters": n, **{label: dict(zip(FRAMEWORKS, pair)) for label, pair in values.items()},
            "ratio": {label: a / b for label, (a, b) in values.items() if a is not None and b}}  # fmt: skip


def case_profile(args, tmp: Path) -> dict:
    import torch

    positions = max(256, args.new_tokens + 64)  # prompt + completion within the model's positions
    n, vocab = build_model(tmp, None, args.hidden, args.layers, args.heads, args.intermediate, positions)
    torch.set_num_threads(args.threads)
    work = throughput_workload(args, tmp)
    print(f"\n## Profile of sgrpo's step: N = {n:,}, {args.prompts} x {args.group_size} x {args.new_tokens} tokens")
    profile_sgrpo(work, args.warmup)
    return {"parameters": n}  # the phase table is the report's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--case", choices=["throughput", "large_vocab", "profile", "ablation"], default="throughput")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per framework")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per framework")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU, bf16-mixed")
    parser.add_argument("--sgrpo-cuda-graphs", action="store_true", help="sgrpo's CUDA-graph decode steps")

    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per completion (T)")
    parser.add_argument(
        "--force-length", action="store_true", help="mask EOS until T tokens: every completion exactly T tokens"
    )
    parser.add_argument(
        "--sgrpo-decoder", choices=["lean", "generate"], default="lean", help="HFRollout's decoder (default lean)"
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1280)
    parser.add_argument(
        "--micro-batch", type=int, help="rows per forward/backward, gradients accumulated (both); default all B x G"
    )
    parser.add_argument(
        "--sgrpo-micro-batch-tokens",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="sgrpo's micro_batch_tokens: the budget of a micro-batch (packed: its modelled cost, about its real "
        "tokens; padded: its padded tokens) (default auto: 1024 on CPU; 0: no limit)",
    )
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off for parity")
    parser.add_argument("--large-vocab", type=int, default=151_936)
    parser.add_argument("--large-hidden", type=int, default=64)
    parser.add_argument("--large-layers", type=int, default=2)
    parser.add_argument("--large-rows", type=int, default=16, help="completions in the large-vocab step (B x G)")
    parser.add_argument("--large-tokens", type=int, default=512, help="new tokens per completion, large-vocab case")
    parser.add_argument("--sgrpo-chunk-mib", type=float, default=128.0, help="sgrpo's logits_chunk_mib (its default)")
    parser.add_argument("--mem-cap-gib", type=float, default=16.0, help="kill a worker whose RSS exceeds this")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        metavar="BYTES",
        help="glibc's mmap threshold in every worker, fixed (MALLOC_MMAP_THRESHOLD_): each freed block above it goes "
        "back to the OS at once, so the peak RSS is the memory in use rather than what the allocator keeps (and "
        "the steps slower); default glibc's own, which rises to the largest block freed",
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = artefact.publish_option(parser).parse_args()
    if args.worker:
        worker_main(args.worker, args.work)
        return
    if args.malloc_mmap_threshold is not None:  # glibc reads it as a process starts: the workers, not this one
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    with tempfile.TemporaryDirectory(prefix="sgrpo_throughput_") as tmp:
        started = time.perf_counter()
        cases = {
            "throughput": case_throughput,
            "large_vocab": case_large_vocab,
            "profile": case_profile,
            "ablation": case_ablation,
        }
        with artefact.recording() as printed:
            result = cases[args.case](args, Path(tmp))
            wall = time.perf_counter() - started
            print(f"\n(wall time {wall:.0f} s)")
        result["wall_s"] = float(round(wall))
    name = "throughput" + "".join(f"_{part}" for part, on in ((args.case, args.case != "throughput"),
                                  ("forced", args.force_length), ("cuda", args.device == "cuda"),
                                  ("mmap", args.malloc_mmap_threshold is not None)) if on)  # fmt: skip
    report = f"# sgrpo against TRL: {args.case}\n" + printed.getvalue()
    artefact.publish_run(args, name, result, report, __file__)


if __name__ == "__main__":
    main()
