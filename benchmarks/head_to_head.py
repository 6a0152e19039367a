"""Head-to-head: the real training loop, one run per estimator x seed, same everything else.

Every run is ``python -m sgrpo.fit --config configs/quickstart.yaml`` (the warm-started char Llama of
``sgrpo/assets/quickstart_model`` on the synthetic sort task, levels 3/5/7; 16 prompts x 8 completions
per step, AdamW lr 3e-4, binary exact-match reward, token-mean aggregation) with only these changed:
``--model.estimator`` (the estimator under test), ``--seed_everything=S --model.seed=S`` (data order,
rollout and validation sampling), ``--trainer.max_steps`` (``--steps``), the validation interval
(``--val-every``) and ``--model.val_samples`` (``--val-samples``); the model validates before training
too. Runs go ``--jobs`` at a time (default 2), each in its own subprocess: a crash is contained (its
log stays in the run folder, the next run goes on), and a re-run skips every run whose
``result.json`` exists, so an interrupted benchmark resumes where it stopped and more seeds can be
added later (``--seeds 0 1 2 3 4`` reuses seeds 0-2).

Estimators are class paths with JSON init args, so a new estimator joins without a code change::

    --estimators estimators.GRPO 'estimators.SoftmaxGRPO:{"temperature": 0.25}' mymodule.HalfRLOO

or a YAML/JSON file holding a list of ``{class_path, init_args}``. The default roster is GRPO,
Dr.GRPO, MaxRL (practical) and SoftmaxGRPO (tau = 0.5), 3 seeds each. The powered recipe of issue 15
(sort 3..9, 8 estimators x 12 seeds, a pre-registered primary metric) is ``head_to_head_tail.py``.

Budget, measured on a project 2-core CPU machine shared with other jobs (load average about 4): the
default 12 runs of 200 steps took 9.6 and 11.4 min of wall clock (two invocations, identical
numbers), two at a time with one torch thread each (1.0 to 2.3 min per run). One thread per run
(``--threads 1``) matters: under that load a run with two OpenMP threads took a median 1.03 s per
training step against 0.15 s with one, and a whole 200-step quickstart run took 11.5 min with two.

Outputs in ``--out`` (default ``benchmarks/results/head_to_head``): one folder per run,
``<estimator>/seed<S>/``, with ``lightning_logs/version_0/metrics.csv``, ``log.txt``, ``hf_model/``
(checkpoints are deleted once the run finished) and ``result.json`` (initial and final accuracy per
difficulty, pass@k overall and per difficulty, the histogram of correct samples per prompt, every
validation, wall time); and the report: ``report.md`` (final accuracy per difficulty with 95 %
t-intervals over seeds, the best estimator and its seed-paired difference against
the runner-up and GRPO, pass@k, gradient budget shares, run times) with ``accuracy_by_difficulty.png``,
``accuracy_curves.png``, ``pass_at_k.png`` and ``budget_shares.png``.

    python benchmarks/head_to_head.py [--steps 200] [--seeds 0 1 2] [--estimators SPEC ...] [--jobs 2]
    python benchmarks/head_to_head.py --report-only          # rebuild the report from finished runs

The report, with its figures as ``result`` (``_h2h_stats.key_figures``), is published to
``benchmarks/reports/head_to_head/`` (``benchmarks/artefact.py``; ``--no-publish`` skips it).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(_ROOT))


from benchmarks import artefact  # noqa: E402
from benchmarks._common import HelpFormatter  # noqa: E402
from benchmarks._h2h_report import _level_key, _rel, write_report  # noqa: E402

# base_runs, conclusion, paired: read as h2h.* by head_to_head_tail.py and the tests
from benchmarks._h2h_stats import base_runs, conclusion, key_figures, paired, run_time_figures  # noqa: E402, F401

DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "head_to_head"
DEFAULT_CONFIG = _ROOT / "configs" / "quickstart.yaml"
DEFAULT_ESTIMATORS = (
    "estimators.GRPO",
    "estimators.DrGRPO",
    'estimators.MaxRL:{"variant": "practical"}',
    'estimators.SoftmaxGRPO:{"temperature": 0.5}',
)


@dataclass(frozen=True)
class EstimatorSpec:
    """An estimator as the CLI takes it: a class path and its init args."""

    class_path: str
    init_args: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.class_path.rsplit(".", 1)[-1]

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.init_args.items())
        return f"{self.name}({args})" if args else self.name

    @property
    def slug(self) -> str:
        """A folder name: ``SoftmaxGRPO_temperature-0.5``."""
        parts = [self.name] + [f"{k}-{v}" for k, v in self.init_args.items()]
        return re.sub(r"[^A-Za-z0-9_.=-]+", "", "_".join(parts))

    def cli_value(self) -> str:
        return json.dumps({"class_path": self.class_path, "init_args": self.init_args})

    def check(self) -> None:
        """Import and build the estimator here, so a typo fails before any run starts."""
        from estimators import AdvantageEstimator

        module, _, name = self.class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise SystemExit(
                f"error: cannot import {self.class_path} ({err}); its module must be importable from the "
                "current folder or PYTHONPATH"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, AdvantageEstimator)):
            raise SystemExit(f"error: {self.class_path} is not an AdvantageEstimator subclass")
        cls(**self.init_args)


def parse_estimators(items: list[str]) -> list[EstimatorSpec]:
    """``module.Class``, ``module.Class:{json init args}`` or a YAML/JSON file of ``{class_path, init_args}``."""
    specs = []
    for item in items:
        if item.endswith((".yaml", ".yml", ".json")) and Path(item).is_file():
            import yaml

            entries = yaml.safe_load(Path(item).read_text())
            specs += [EstimatorSpec(e["class_path"], dict(e.get("init_args") or {})) for e in entries]
            continue
        path, sep, raw = item.partition(":")
        try:
            init_args = json.loads(raw) if sep else {}
        except json.JSONDecodeError as err:
            raise SystemExit(
                f"error: init args of {item!r} are not JSON ({err}); write e.g. "
                "'estimators.SoftmaxGRPO:{\"temperature\": 0.5}'"
            ) from None
        specs.append(EstimatorSpec(path, init_args))
    if len({s.slug for s in specs}) != len(specs):
        raise SystemExit("error: two estimators share a name; give them different init args")
    return specs


# ---------------------------------------------------------------------------------------------- running
def fit_command(spec: EstimatorSpec, seed: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "sgrpo.fit", "--config", str(args.config),
        f"--model.estimator={spec.cli_value()}",
        f"--seed_everything={seed}", f"--model.seed={seed}",
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.max_steps={args.steps}", f"--trainer.val_check_interval={args.val_every}",
        f"--model.val_samples={args.val_samples}",
        "--validate_before=true", "--report=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        *shlex.split(args.extra),
    ]  # fmt: skip


def validations(metrics_csv: Path, val_every: int) -> list[dict]:
    """Every validation of a run from its ``metrics.csv``, in order: accuracy per difficulty and pass@k.

    Each validation is one CSV row holding ``val/accuracy``, its ``step`` column the training steps done
    (0 before training, N after N steps; runs before 2026-12-04 logged N - 1), so the history counts them
    by position: 0, ``val_every``, 2 ``val_every``, ... as ``val_history``.
    """
    with open(metrics_csv, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/accuracy")]
    history = []
    for i, row in enumerate(rows):
        levels = {k.rsplit("/", 1)[-1]: float(v) for k, v in row.items() if k.startswith("val/accuracy/") and v}
        passes = {k.rsplit("@", 1)[-1]: float(v) for k, v in row.items() if re.fullmatch(r"val/pass@\d+", k) and v}
        by_level: dict[str, dict[str, float]] = {}  # val/pass@<k>/<level>, when the run logged it
        for key, value in row.items():
            if (m := re.fullmatch(r"val/pass@(\d+)/(.+)", key)) and value:
                by_level.setdefault(m[2], {})[m[1]] = float(value)
        counts = {int(k.rsplit("/", 1)[-1]): float(v) for k, v in row.items() if k.startswith("val/successes/") and v}
        history.append({
            "step": i * val_every,
            "by_difficulty": dict(sorted(levels.items(), key=lambda kv: _level_key(kv[0]))),
            "pass_at_k": dict(sorted(passes.items(), key=lambda kv: int(kv[0]))),
            "pass_at_k_by_difficulty": {
                lv: dict(sorted(by_k.items(), key=lambda kv: int(kv[0])))
                for lv, by_k in sorted(by_level.items(), key=lambda kv: _level_key(kv[0]))
            },
            "success_counts": [counts[c] for c in sorted(counts)],
            "mean_over_levels": sum(levels.values()) / max(len(levels), 1),
        })  # fmt: skip
    return history


def say(line: str) -> None:
    """One line to stdout in one write, so lines of parallel runs do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_settings(args: argparse.Namespace) -> dict:
    """What a finished run must share with this invocation to be reused."""
    return {
        "config": _rel(args.config),
        "steps": args.steps,
        "val_every": args.val_every,
        "val_samples": args.val_samples,
        "extra": args.extra,
    }


def run_one(spec: EstimatorSpec, seed: int, args: argparse.Namespace, threads: int) -> dict | None:
    """Train one run in a subprocess (or reuse its ``result.json``); None if it failed."""
    run_dir = args.out / spec.slug / f"seed{seed}"
    result_path = run_dir / "result.json"
    if result_path.exists():
        say(f"[skip] {spec.label} seed {seed}: {result_path} exists")
        return json.loads(result_path.read_text())
    if run_dir.exists():  # an unfinished run (no result.json): start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), os.getcwd(), env.get("PYTHONPATH", "")) if p)
    say(f"[run]  {spec.label} seed {seed} -> {run_dir}")
    started = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        rc = subprocess.run(
            fit_command(spec, seed, run_dir, args), cwd=_ROOT, env=env, stdout=log, stderr=log
        ).returncode
    wall = time.perf_counter() - started
    metrics_csv = run_dir / "lightning_logs" / "version_0" / "metrics.csv"
    history = validations(metrics_csv, args.val_every) if rc == 0 and metrics_csv.exists() else []
    if rc != 0 or len(history) != args.steps // args.val_every + 1:
        tail = (run_dir / "log.txt").read_text().splitlines()[-15:]
        say(f"[fail] {spec.label} seed {seed} (exit {rc}); log {run_dir / 'log.txt'}:\n  " + "\n  ".join(tail))
        return None
    result = {
        "estimator": spec.label, "class_path": spec.class_path, "init_args": spec.init_args, "seed": seed,
        **run_settings(args), "wall_s": round(wall, 1), "threads": threads, "jobs": args.jobs,
        "initial": history[0], "final": history[-1], "history": history,
    }  # fmt: skip
    result_path.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 8 MB a run; the trained policy stays in hf_model/
    first, last = history[0]["mean_over_levels"], history[-1]["mean_over_levels"]
    say(f"[done] {spec.label} seed {seed}: {wall:.0f} s, mean accuracy over levels {first:.1%} -> {last:.1%}")
    return result


def run_all(specs: list[EstimatorSpec], args: argparse.Namespace) -> dict[str, dict[int, dict]]:
    """Seed-major order (every estimator's seed 0 first), so a cut-short benchmark is still paired."""
    jobs = [(spec, seed) for seed in args.seeds for spec in specs]
    results: dict[str, dict[int, dict]] = {s.label: {} for s in specs}
    settings = run_settings(args)
    for spec, seed in jobs:  # a finished run is reused only if it was trained as this invocation would
        path = args.out / spec.slug / f"seed{seed}" / "result.json"
        if path.exists() and any(json.loads(path.read_text()).get(k, v) != v for k, v in settings.items()):
            raise SystemExit(
                f"error: {path} was made with other settings than {settings}; "
                "use another --out, or delete that run folder to run it again"
            )
    if args.report_only:
        for spec, seed in jobs:
            path = args.out / spec.slug / f"seed{seed}" / "result.json"
            if path.exists():
                results[spec.label][seed] = json.loads(path.read_text())
        return results
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = pool.map(lambda job: run_one(*job, args, args.threads), jobs)
        for (spec, seed), result in zip(jobs, outcomes):
            if result is not None:
                results[spec.label][seed] = result
    return results


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--estimators",
        nargs="+",
        default=list(DEFAULT_ESTIMATORS),
        metavar="SPEC",
        help="module.Class[:{JSON init args}] or a YAML/JSON file of {class_path, init_args}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seed_everything and model.seed")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (trainer.max_steps)")
    parser.add_argument("--val-every", type=int, default=50, help="validation interval in steps (<= --steps)")
    parser.add_argument("--val-samples", type=int, default=4, help="samples per validation prompt (pass@1..k)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the base config of every run")
    parser.add_argument(
        "--extra",
        default="",
        help="more sgrpo.fit arguments for every run, one string: write --extra='--model.x=1 ...'",
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each in its own process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run folders and the report")
    parser.add_argument("--report-only", action="store_true", help="no training: report the finished runs")
    args = artefact.publish_option(parser).parse_args(argv)
    args.val_every = min(args.val_every, args.steps)
    if args.steps < 1 or args.steps % args.val_every:
        parser.error(f"--steps ({args.steps}) must be a positive multiple of --val-every ({args.val_every}), "
                     "so the last validation falls on the last step")  # fmt: skip
    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be >= 1, got {args.jobs} and {args.threads}")
    args.out, args.config = args.out.resolve(), args.config.resolve()
    args.started = time.perf_counter()
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    specs = parse_estimators(args.estimators)
    if os.getcwd() not in sys.path:  # a user's estimator module in the current folder, as the runs see it
        sys.path.append(os.getcwd())
    for spec in specs:
        spec.check()
    started = time.perf_counter()
    results = run_all(specs, args)
    path = write_report(results, specs, args)
    if any(results.values()):  # the command without --report-only: it reruns (or reuses) the runs themselves
        figures = key_figures(results, specs, args.out)
        # the wall clock of an invocation that ran the runs (a --report-only one only read them)
        figures["run_time"] = run_time_figures(results, None if args.report_only else time.perf_counter() - started)
        artefact.publish_run(args, "head_to_head", figures, path.read_text(), __file__, argv,
                             drop=("--report-only",))  # fmt: skip
    print(f"\n{path.read_text().split('## pass@k')[0]}report: {path} ({(time.perf_counter() - started) / 60:.1f} min)")
    return path


if __name__ == "__main__":
    main()
