"""Advantage-estimator benchmark: speed on 100,000 groups of 16, and the library's c_G(p) table.

Run with ``make bench`` or ``.venv/bin/python benchmarks/estimators.py [--threads N] [--repeats N]``.
It prints (never asserts):

1. the median wall time (and process CPU time), after warm-up, of ``est(rewards)`` for 100,000
   groups of 16 float32 rewards, random binary and random uniform in [0, 1], for every class in
   ``estimators.ESTIMATORS`` (SoftmaxGRPO at tau = 0.5 and 1); the target is under 50 ms wall per
   estimator with 2 torch threads on 2 CPUs. The header prints the load average: on a shared
   machine, other processes inflate the wall time (each multi-threaded kernel waits for a CPU);
2. the table of c_G(p) for G = 8 (docs/reference_numbers.md §8.1), computed by the library's exact
   ``population_weight``, with c(0+) and c(1-) as its values at p = 0 and p = 1.

What it prints is published to ``benchmarks/reports/estimators/`` (``benchmarks/artefact.py``; ``--no-publish``
skips it), with the wall and CPU milliseconds of the speed table and the c_G(p) rows as its ``result``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# ``estimators`` package: import the package from the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from benchmarks import artefact  # noqa: E402
from estimators import ESTIMATORS, GRPO, AdvantageEstimator, MaxRL, SoftmaxGRPO  # noqa: E402

N_GROUPS, GROUP_SIZE = 100_000, 16
TARGET_MS = 50.0

#: constructor arguments per class for the speed table; a class not listed is built with no arguments
SPEED_ARGS: dict[type[AdvantageEstimator], list[dict]] = {
    SoftmaxGRPO: [{"temperature": 0.5}, {"temperature": 1.0}],
}
#: constructor arguments per class for the c_G(p) table (the rows of docs/reference_numbers.md §8.1)
TABLE_ARGS: dict[type[AdvantageEstimator], list[dict]] = {
    GRPO: [{"std": "population", "eps": 0.0}, {"std": "sample", "eps": 0.0}],  # §5 is at eps = 0
    MaxRL: [{"variant": "practical"}, {"variant": "cv_unbiased"}, {"variant": "nocv"}],
    SoftmaxGRPO: [{"temperature": t} for t in (0.25, 0.5, 1.0, 2.0, 4.0)],
}


def instances(args_by_class: dict[type[AdvantageEstimator], list[dict]]) -> list[AdvantageEstimator]:
    return [cls(**kwargs) for cls in ESTIMATORS for kwargs in args_by_class.get(cls, [{}])]


def label(est: AdvantageEstimator) -> str:
    """The class name and the settings that differ from the constructor's defaults."""
    params = inspect.signature(type(est).__init__).parameters
    fields = []
    for key, value in vars(est).items():
        default = params[key].default if key in params else inspect.Parameter.empty
        if not key.startswith("_") and default != value:
            fields.append(f"{key}={value}")
    return f"{type(est).__name__}({', '.join(fields)})"


def median_ms(fn, warmup: int, repeats: int) -> tuple[float, float]:
    """Median wall-clock and process-CPU milliseconds per call, after ``warmup`` calls.

    On a shared machine the wall time includes waiting for a CPU; the CPU time does not (with
    several threads it adds their time together, including OpenMP spin-waits).
    """
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def speed_table(warmup: int, repeats: int) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "binary": (torch.rand(N_GROUPS, GROUP_SIZE, generator=gen) < 0.5).to(torch.float32),
        "uniform": torch.rand(N_GROUPS, GROUP_SIZE, generator=gen, dtype=torch.float32),
    }
    print(f"### Advantages for {N_GROUPS:,} groups of {GROUP_SIZE} (float32 in), median of {repeats} runs")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs, "
        f"load average {load}; target < {TARGET_MS:g} ms wall\n"
    )
    print("| estimator | binary wall (ms) | binary CPU (ms) | uniform wall (ms) | uniform CPU (ms) | target |")
    print("|---|---:|---:|---:|---:|---|")
    out = {}
    for est in instances(SPEED_ARGS):
        ms = {name: median_ms(lambda r=r, est=est: est(r), warmup, repeats) for name, r in inputs.items()}
        verdict = "ok" if max(wall for wall, _ in ms.values()) < TARGET_MS else "SLOW"
        (bw, bc), (uw, uc) = ms["binary"], ms["uniform"]
        print(f"| {label(est)} | {bw:.1f} | {bc:.1f} | {uw:.1f} | {uc:.1f} | {verdict} |")
        out[label(est)] = {"binary_wall_ms": bw, "binary_cpu_ms": bc, "uniform_wall_ms": uw, "uniform_cpu_ms": uc}
    return out


def weight_table(group_size: int = 8) -> dict[str, list[float]]:
    ps = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    print(f"\n### c_G(p) for G = {group_size} (exact, from population_weight; docs/reference_numbers.md §8.1)\n")
    head = " | ".join(f"p={p:g}" for p in ps.tolist())
    print(f"| estimator | {head} | c(0+) | c(1-) |")
    print("|---|" + "---:|" * (len(ps) + 2))
    out = {}
    for est in instances(TABLE_ARGS):
        c = est.population_weight(ps, group_size).tolist()
        ends = est.population_weight(torch.tensor([0.0, 1.0], dtype=torch.float64), group_size).tolist()
        cells = " | ".join(f"{v:.4f}" for v in c)
        print(f"| {label(est)} | {cells} | {ends[0]:.3f} | {ends[1]:.3f} |")
        out[label(est)] = [*c, *ends]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=11)
    args = artefact.publish_option(parser).parse_args()
    torch.set_num_threads(args.threads)
    with artefact.recording() as printed:
        result = {"speed": speed_table(args.warmup, args.repeats), "c_G8": weight_table()}
    report = "# Advantage estimators: speed and c_G(p)\n\n" + printed.getvalue()
    artefact.publish_run(args, "estimators", result, report, __file__)


if __name__ == "__main__":
    main()
