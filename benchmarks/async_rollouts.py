"""Asynchronous rollouts against synchronous training on the quickstart (issue 35).

    python benchmarks/async_rollouts.py [--steps 100] [--seeds 0 1] [--staleness 1 2 4] [--val-every 25]
                                        [--threads 1] [--no-publish]

Each run is ``python -m sgrpo.fit --config configs/quickstart.yaml`` in a fresh process (SoftmaxGRPO on the sort
task, 16 prompts x 8 completions a step, the shipped tiny model, CPU), with ``--model.async_rollout=true
--model.max_staleness=S`` for each S of ``--staleness``, once per seed (``seed_everything`` and ``model.seed``),
``OMP_NUM_THREADS=--threads`` (the synchronous trainer's threads; an async run splits them between its trainer
and its producer, ``sgrpo.train.asynchronous.thread_split``). Validation (150 prompts, 4 samples) runs every
``--val-every`` steps. Each run goes through ``benchmarks._async_probe``, which times the trainer's phases.

Wall-clock is the trainer's: the sum of ``train/time/step_s`` (sampling or waiting for the producer, scoring,
the update, the weight push) over steps 1 .. k. Step 0 is left out of every run: in an async run it holds the
producer's start (a fork server importing torch and transformers, once per run here); validations are left out
too (they are the same work in every run). *Time to target* is the wall-clock at the first validation whose
accuracy reaches the synchronous run's final accuracy of the same seed (None: never within ``--steps``);
*step speed-up* is the synchronous run's mean step time over the run's. *CPU-bound speed-up* is the synchronous
trainer's CPU seconds per step over max(the async trainer's, its producer's): what the overlap gives where each
process has a core of its own, read from CPU time, which other jobs on a crowded machine inflate far less than
wall time. Also reported: final accuracy, ESS (``train/offpolicy/ess``, mean over the stale steps), mean and max
staleness, producer idle and trainer wait seconds per step, and each phase's CPU seconds per step. Prints, never
asserts; published to ``benchmarks/reports/async_rollouts/`` (``benchmarks/artefact.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import artefact  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "async_rollouts"


def fit(name: str, seed: int, steps: int, val_every: int, staleness: int | None, results: Path, threads: int) -> dict:
    """One quickstart run; its per-step and validation series and its phase timings (``benchmarks._async_probe``)."""
    from sgrpo.eval.report import read_run_metrics

    root = results / name
    probe = results / f"{name}.probe.json"
    command = [sys.executable, "-m", "benchmarks._async_probe", str(probe),
               "--config", "configs/quickstart.yaml", "--overwrite=true",
               f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
               f"--trainer.val_check_interval={val_every}", "--trainer.enable_progress_bar=false",
               "--report=false", "--validate_before=false", f"--seed_everything={seed}",
               f"--model.seed={seed}"]  # fmt: skip
    if staleness is not None:
        command += ["--model.async_rollout=true", f"--model.max_staleness={staleness}"]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = read_run_metrics(root)
    series = {key: [v for _, v in metrics[key]] for key in ("train/time/step_s", "train/reward")}
    out = {"wall_s": time.perf_counter() - started, "step_s": series["train/time/step_s"],
           "reward": series["train/reward"], "val": [[s, v] for s, v in metrics["val/accuracy"]]}  # fmt: skip
    for key in ("staleness_mean", "staleness_max", "producer_idle_s", "trainer_wait_s", "weight_sync_s"):
        values = [v for _, v in metrics.get(f"train/async/{key}", [])]
        out[key] = values
    out["ess"] = [v for _, v in metrics.get("train/offpolicy/ess", [])]  # stale steps only
    out["probe"] = json.loads(probe.read_text())
    return out


def time_to(run: dict, target: float) -> float | None:
    """Trainer seconds (steps 1 .. k) at the first validation (after step k) with accuracy >= ``target``."""
    for step, accuracy in run["val"]:  # logged at the step count of the last trained step
        if accuracy >= target - 1e-9:
            return sum(run["step_s"][1 : int(step) + 1])
    return None


def summary(runs: dict[str, dict[int, dict]]) -> dict:
    out = {}
    for name, by_seed in runs.items():
        rows = []
        for seed, run in by_seed.items():
            target = runs["sync"][seed]["val"][-1][1]
            reach, sync_reach = time_to(run, target), time_to(runs["sync"][seed], target)
            mean_step = statistics.fmean(run["step_s"][1:])
            rows.append({
                "seed": seed, "final_accuracy": run["val"][-1][1], "target": target, "time_to_target_s": reach,
                "speedup_to_target": None if reach is None or not reach else sync_reach / reach,
                "mean_step_s": mean_step,
                "step_speedup": statistics.fmean(runs["sync"][seed]["step_s"][1:]) / mean_step,
                "staleness_mean": statistics.fmean(run["staleness_mean"]) if run["staleness_mean"] else 0.0,
                "staleness_max": max(run["staleness_max"], default=0.0),
                "producer_idle_s": statistics.fmean(run["producer_idle_s"][1:]) if run["producer_idle_s"] else None,
                "trainer_wait_s": statistics.fmean(run["trainer_wait_s"][1:]) if run["trainer_wait_s"] else None,
                "ess": statistics.fmean(run["ess"]) if run["ess"] else None,
                "trainer_cpu_s": run["probe"]["trainer_cpu_s"], "producer_cpu_s": run["probe"]["producer_cpu_s"],
                "cpu_speedup": runs["sync"][seed]["probe"]["trainer_cpu_s"]
                / max(run["probe"]["trainer_cpu_s"], run["probe"]["producer_cpu_s"]),
                "phases_cpu_s": {k: v["cpu_s"] for k, v in run["probe"]["phases"].items()},
            })  # fmt: skip
        out[name] = rows
    return out


#: the phases of ``benchmarks._async_probe`` the report shows, in step order
PHASES = ("sample", "score", "proximal_forward", "update", "push", "log", "step")


def _num(value: float | None, digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def report(result: dict) -> str:
    """Per run and seed, then per run (means over seeds, the issue's figures side by side), then the phases."""
    lines = ["# Asynchronous rollouts on the quickstart", "",
             "| run | seed | final accuracy | time to sync's final (s) | speed-up to it | step speed-up | "
             "CPU-bound speed-up | ESS | staleness mean / max | producer idle s/step | trainer wait s/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, rows in result["summary"].items():
        for r in rows:
            reach = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
            lines.append(f"| {name} | {r['seed']} | {r['final_accuracy']:.3f} | {reach} | "
                         f"{_num(r['speedup_to_target'], 2, 'x')} | {r['step_speedup']:.2f}x | "
                         f"{r['cpu_speedup']:.2f}x | {_num(r['ess'])} | "
                         f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {_num(r['producer_idle_s'])} | "
                         f"{_num(r['trainer_wait_s'])} |")  # fmt: skip
    lines += ["", "Means over seeds (speed-up to sync's final: over the seeds that reached it):", "",
              "| run | final accuracy (min-max) | reached sync's final | speed-up to it | step speed-up | "
              "CPU-bound speed-up | ESS | staleness mean / max |", "|---|" + "---:|" * 7]  # fmt: skip
    for name, rows in result["summary"].items():
        accuracy = [r["final_accuracy"] for r in rows]
        reached = [r["speedup_to_target"] for r in rows if r["speedup_to_target"] is not None]
        ess = [r["ess"] for r in rows if r["ess"] is not None]
        lines.append(f"| {name} | {min(accuracy):.3f}-{max(accuracy):.3f} | {len(reached)} of {len(rows)} | "
                     f"{_num(statistics.fmean(reached) if reached else None, 2, 'x')} | "
                     f"{statistics.fmean(r['step_speedup'] for r in rows):.2f}x | "
                     f"{statistics.fmean(r['cpu_speedup'] for r in rows):.2f}x | "
                     f"{_num(statistics.fmean(ess) if ess else None)} | "
                     f"{statistics.fmean(r['staleness_mean'] for r in rows):.2f} / "
                     f"{max(r['staleness_max'] for r in rows):.0f} |")  # fmt: skip
    lines += ["", "CPU seconds per step (means over seeds; phases per call, the trainer's thread; `update` holds "
              "`proximal_forward`, `step` all of them): trainer and producer process totals per step.", "",
              "| run | " + " | ".join(PHASES) + " | trainer | producer |",
              "|---|" + "---:|" * (len(PHASES) + 2)]  # fmt: skip
    for name, rows in result["summary"].items():
        cells = [statistics.fmean(r["phases_cpu_s"].get(p, 0.0) for r in rows) for p in PHASES]
        cells += [statistics.fmean(r[k] for r in rows) for k in ("trainer_cpu_s", "producer_cpu_s")]
        lines.append(f"| {name} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = artefact.publish_option(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run (async: split)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    configs = {"sync": None} | {f"S={s}": s for s in args.staleness}
    runs: dict[str, dict[int, dict]] = {name: {} for name in configs}
    for seed in args.seeds:  # seeds outer: a machine whose load drifts spreads it over every config
        for name, staleness in configs.items():
            runs[name][seed] = fit(f"{name.replace('=', '')}_seed{seed}", seed, args.steps, args.val_every,
                                   staleness, RESULTS, args.threads)  # fmt: skip
            print(f"{name} seed {seed}: {runs[name][seed]['wall_s']:.0f} s, final accuracy "
                  f"{runs[name][seed]['val'][-1][1]:.3f}", flush=True)  # fmt: skip
    result = {"steps": args.steps, "seeds": args.seeds, "staleness": args.staleness, "val_every": args.val_every,
              "threads": args.threads, "runs": runs, "summary": summary(runs),
              "wall_s": time.perf_counter() - started}  # fmt: skip
    text = report(result)
    print(text)
    artefact.publish_run(args, "async_rollouts", result, text, __file__, argv)
    return result


if __name__ == "__main__":
    main()
