"""Asynchronous rollouts against synchronous training on the quickstart (issue 35).

    python benchmarks/async_rollouts.py [--steps 200] [--seeds 0 1] [--staleness 1 2 4] [--val-every 50] [--no-publish]

Each run is ``python -m sgrpo.fit --config configs/quickstart.yaml`` in a fresh process (SoftmaxGRPO on the sort
task, 16 prompts x 8 completions a step, the shipped tiny model, CPU), with ``--model.async_rollout=true
--model.max_staleness=S`` for each S of ``--staleness``, once per seed (``seed_everything`` and ``model.seed``).
Validation (150 prompts, 4 samples) runs every ``--val-every`` steps.

Wall-clock is the trainer's: the sum of ``train/time/step_s`` (sampling or waiting for the producer, scoring,
the update, the weight push) over steps 1 .. k. Step 0 is left out of every run: in an async run it holds the
producer's start (a fork server importing torch and transformers, once per run here); validations are left out
too (they are the same work in every run). *Time to target* is the wall-clock at the first validation whose
accuracy reaches the synchronous run's final accuracy of the same seed (None: never within ``--steps``);
*step speed-up* is the synchronous run's mean step time over the run's. Also reported: final accuracy, mean and
max staleness, producer idle and trainer wait seconds per step. ESS and the importance-weight metrics belong to
the decoupled objective (the ``offpolicy`` branch) and are not measured here: until it merges, a stale group
trains with today's update (no correction for the HF engine). Prints, never asserts; published to
``benchmarks/reports/async_rollouts/`` (``benchmarks/artefact.py``).
"""

from __future__ import annotations

import argparse
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


def fit(name: str, seed: int, steps: int, val_every: int, staleness: int | None, results: Path) -> dict:
    """One quickstart run; its per-step and validation series."""
    from sgrpo.eval.report import read_run_metrics

    root = results / name
    command = [sys.executable, "-m", "sgrpo.fit", "--config", "configs/quickstart.yaml", "--overwrite=true",
               f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
               f"--trainer.val_check_interval={val_every}", "--trainer.enable_progress_bar=false",
               "--report=false", "--validate_before=false", f"--seed_everything={seed}",
               f"--model.seed={seed}"]  # fmt: skip
    if staleness is not None:
        command += ["--model.async_rollout=true", f"--model.max_staleness={staleness}"]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env=os.environ | {"OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", "1")}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = read_run_metrics(root)
    series = {key: [v for _, v in metrics[key]] for key in ("train/time/step_s", "train/reward")}
    out = {"wall_s": time.perf_counter() - started, "step_s": series["train/time/step_s"],
           "reward": series["train/reward"], "val": [[s, v] for s, v in metrics["val/accuracy"]]}  # fmt: skip
    for key in ("staleness_mean", "staleness_max", "producer_idle_s", "trainer_wait_s", "weight_sync_s"):
        values = [v for _, v in metrics.get(f"train/async/{key}", [])]
        out[key] = values
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
            })  # fmt: skip
        out[name] = rows
    return out


def report(result: dict) -> str:
    lines = ["# Asynchronous rollouts on the quickstart", "",
             "| run | seed | final accuracy | time to sync's final (s) | speed-up to it | step speed-up | "
             "staleness mean / max | producer idle s/step | trainer wait s/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, rows in result["summary"].items():
        for r in rows:
            reach = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
            speed = "-" if r["speedup_to_target"] is None else f"{r['speedup_to_target']:.2f}x"
            idle = "-" if r["producer_idle_s"] is None else f"{r['producer_idle_s']:.3f}"
            wait = "-" if r["trainer_wait_s"] is None else f"{r['trainer_wait_s']:.3f}"
            lines.append(f"| {name} | {r['seed']} | {r['final_accuracy']:.3f} | {reach} | {speed} | "
                         f"{r['step_speedup']:.2f}x | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {idle} | "
                         f"{wait} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = artefact.publish_option(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--val-every", type=int, default=50)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    configs = {"sync": None} | {f"S={s}": s for s in args.staleness}
    runs: dict[str, dict[int, dict]] = {name: {} for name in configs}
    for seed in args.seeds:  # seeds outer: a machine whose load drifts spreads it over every config
        for name, staleness in configs.items():
            runs[name][seed] = fit(f"{name.replace('=', '')}_seed{seed}", seed, args.steps, args.val_every,
                                   staleness, RESULTS)  # fmt: skip
            print(f"{name} seed {seed}: {runs[name][seed]['wall_s']:.0f} s, final accuracy "
                  f"{runs[name][seed]['val'][-1][1]:.3f}", flush=True)  # fmt: skip
    result = {"steps": args.steps, "seeds": args.seeds, "staleness": args.staleness, "val_every": args.val_every,
              "threads": int(os.environ.get("OMP_NUM_THREADS", "1")), "runs": runs, "summary": summary(runs),
              "wall_s": time.perf_counter() - started}  # fmt: skip
    text = report(result)
    print(text)
    artefact.publish_run(args, "async_rollouts", result, text, __file__, argv)
    return result


if __name__ == "__main__":
    main()
