"""The tool quickstart learns: ``configs/tools_quickstart.yaml`` run for a few seeds, base against trained.

Every run is ``python -m sgrpo.fit --config configs/tools_quickstart.yaml`` (the calculator task with the
``add`` and ``mul`` tools, from the warm-started chat model of ``sgrpo/assets/tools_model``) with only these
changed: ``--seed_everything=S --model.seed=S``, ``--trainer.max_steps`` (``--steps``), and the run's own
validation switched off (this script measures instead). Each run's base and trained model are then measured
alike, with the same sampling seed: ``--samples`` episodes per validation prompt (``--eval-prompts`` per level
and operation, the config's validation split), sampled at temperature 1 as training samples, with the config's
tool environment (``sgrpo.warmstart_tools.evaluate``): success and tool-use rate (episodes that call a tool)
per level. From the run's ``metrics.jsonl``: the training reward and tool-use rate, means over its first and
last ``--window`` steps. Runs go ``--jobs`` at a time, each in its own subprocess with one torch thread.

    .venv/bin/python benchmarks/tools_quickstart.py [--seeds 0 1 2] [--steps 80] [--jobs 2]

Publishes ``benchmarks/reports/tools_quickstart/`` (``benchmarks/artefact.py``; ``--no-publish`` skips it);
run folders go to ``--out`` (default ``benchmarks/results/tools_quickstart``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))

from benchmarks import artefact  # noqa: E402

CONFIG = "configs/tools_quickstart.yaml"
KEYS = ("train/reward", "train/episode/tool_use_rate")


def fit_command(seed: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "sgrpo.fit", "--config", CONFIG, f"--seed_everything={seed}", f"--model.seed={seed}",
            f"--trainer.max_steps={args.steps}", f"--trainer.default_root_dir={run_dir}", "--validate_before=false",
            "--trainer.limit_val_batches=0", "--report=false", "--overwrite=true"]  # fmt: skip


def curve_ends(metrics: Path, window: int) -> dict[str, list[float]]:
    """For each of ``KEYS``: [mean over the first ``window`` logged steps, mean over the last ``window``]."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    out = {}
    for key in KEYS:
        values = [row[key] for row in rows if key in row]
        out[key] = [round(sum(values[:window]) / window, 4), round(sum(values[-window:]) / window, 4)]
    return out


def measure(path: str, seed: int, args: argparse.Namespace) -> dict:
    """Sampled success and tool-use per level of the model at ``path`` (``sgrpo.warmstart_tools.evaluate``), in a
    process of its own (sampling seeds are global: runs measured side by side must not share them)."""
    command = [sys.executable, __file__, "--measure", path, str(seed), "--levels", *map(str, args.levels),
               "--eval-prompts", str(args.eval_prompts), "--samples", str(args.samples)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"measuring {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured(path: str, seed: int, args: argparse.Namespace) -> dict:
    """What ``measure`` prints: the model at ``path`` measured in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgrpo.warmstart_tools import Recipe, evaluate, make_task

    torch.set_num_threads(1)
    recipe = Recipe(seed=0, levels=tuple(args.levels))  # the config's task: seed 0, its levels, both operations
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    result = evaluate(model, tokenizer, make_task(recipe, args.eval_prompts), recipe, seed, args.samples, ("sampled",))
    return result["sampled"]


def run_one(seed: int, args: argparse.Namespace) -> dict:
    run_dir = args.out / f"seed{seed}"
    done = run_dir / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        rc = subprocess.run(fit_command(seed, run_dir, args), cwd=_ROOT, env=env, stdout=log, stderr=log).returncode
    if rc:
        raise RuntimeError(f"seed {seed}: sgrpo.fit exited {rc}; see {run_dir / 'log.txt'}")
    fit_s = time.perf_counter() - start
    result = {"seed": seed, "fit_seconds": round(fit_s, 1),
              "base": measure(str(_ROOT / "sgrpo" / "assets" / "tools_model"), seed, args),
              "trained": measure(str(run_dir / "hf_model"), seed, args),
              "train": curve_ends(run_dir / "metrics.jsonl", args.window)}  # fmt: skip
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4)


def summary(runs: list[dict], levels: list[int]) -> dict:
    """Means over seeds: per level and over levels, base and trained, success and tool use."""
    out: dict = {}
    for stage in ("base", "trained"):
        for metric in ("success", "tool_use"):
            per_level = {str(n): mean([r[stage][metric][str(n)] for r in runs]) for n in levels}
            out[f"{stage}_{metric}"] = per_level | {"mean": mean(list(per_level.values()))}
    for key in KEYS:
        out[key] = [mean([r["train"][key][i] for r in runs]) for i in (0, 1)]
    return out


def report(result: dict) -> str:
    s, levels = result["summary"], [str(n) for n in result["levels"]]
    lines = ["# Tool quickstart: base against trained", "",
             f"{len(result['runs'])} seeds x {result['steps']} steps; {result['samples']} sampled episodes per "
             f"prompt, {result['eval_prompts']} prompts per level and operation.", "",
             "| level | success base | success trained | tool use base | tool use trained |",
             "|---|---|---|---|---|"]  # fmt: skip
    for n in [*levels, "mean"]:
        lines.append(f"| {n} | {s['base_success'][n]:.3f} | {s['trained_success'][n]:.3f} | "
                     f"{s['base_tool_use'][n]:.3f} | {s['trained_tool_use'][n]:.3f} |")  # fmt: skip
    lines += ["", "| seed | success base -> trained | tool use base -> trained | train reward first -> last | fit s |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in result["runs"]:
        b, t = r["base"], r["trained"]
        avg = lambda d: sum(d[n] for n in levels) / len(levels)  # noqa: E731
        reward = r["train"]["train/reward"]
        lines.append(f"| {r['seed']} | {avg(b['success']):.3f} -> {avg(t['success']):.3f} | "
                     f"{avg(b['tool_use']):.3f} -> {avg(t['tool_use']):.3f} | {reward[0]:.3f} -> {reward[1]:.3f} | "
                     f"{r['fit_seconds']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3], help="the config's levels")
    parser.add_argument("--eval-prompts", type=int, default=20, help="validation prompts per level and operation")
    parser.add_argument("--samples", type=int, default=2, help="sampled episodes per prompt")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end of the training curves")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results" / "tools_quickstart")
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "SEED"), help=argparse.SUPPRESS)
    args = artefact.publish_option(parser).parse_args(argv)
    if args.measure:  # one model measured (a subprocess of ``measure``): its figures as one JSON line
        print(json.dumps(measured(args.measure[0], int(args.measure[1]), args)))
        return
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda seed: run_one(seed, args), args.seeds))
    result = {"config": CONFIG, "steps": args.steps, "levels": args.levels, "eval_prompts": args.eval_prompts,
              "samples": args.samples, "window": args.window, "runs": runs, "summary": summary(runs, args.levels),
              "wall_s": round(time.perf_counter() - start, 1)}  # fmt: skip
    text = report(result)
    print(text)
    artefact.publish_run(args, "tools_quickstart", result, text, __file__, argv)


if __name__ == "__main__":
    main()
