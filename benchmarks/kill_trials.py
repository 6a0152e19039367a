"""kill -9 during checkpoint and export writes, then ``--ckpt_path last``: does the run end as if never killed?

    .venv/bin/python benchmarks/kill_trials.py --trials 20 [--seed 0] [--workdir DIR] [--no-publish]

A 1-process fit of configs/tiny.yaml (``--checkpoint_every=2 --keep_last=2``: a ``stepN.ckpt`` write, a
``last.ckpt`` link and, at the end, the ``hf_model/`` export) runs once uninterrupted, counting the I/O events
of its writes: each chunk ``torch.save`` writes into a checkpoint, each ``os.fsync`` / ``os.replace`` /
``os.link`` / ``os.rename`` / file opened for writing / safetensors file, inside a checkpoint write, a
``last.ckpt`` link or the end-of-fit export, and the end of each of those. Each trial then runs the same fit
and SIGKILLs it (``os.kill(pid, SIGKILL)``: nothing runs after it, as with ``kill -9`` from outside) just before
an event drawn at random, resumes with ``--ckpt_path last`` (or, where the kill came before the first checkpoint
was complete and the resume is refused with "nothing to resume", starts again with ``--overwrite true`` as the
refusal says), and compares with the uninterrupted run: every deterministic metric of every step
(``metrics.jsonl``, read as the report reads it; timings excluded) and every tensor of ``hf_model/`` and of
``last.ckpt``'s weights, bit for bit. The kill is drawn in the process itself, at an event, because a tiny
model's write lasts milliseconds: a kill from outside at a random instant would almost never land in one.
The trials and their summary are published to ``benchmarks/reports/kill_trials/`` (``--from-log FILE`` publishes
the trials a run printed, one JSON line each, without running them again).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]  # shadows `estimators`
sys.path.insert(0, str(REPO))
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 6


def fit_args(root: Path, *extra: str) -> list[str]:
    return [
        "--config", TINY, f"--trainer.default_root_dir={root}", f"--trainer.max_steps={STEPS}",
        "--trainer.val_check_interval=3", "--checkpoint_every=2", "--keep_last=2",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", *extra,
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------- in the fit's process
def instrument(kill_at: int | None, record: Path) -> None:
    """Count the I/O events of checkpoint writes, links and the export; SIGKILL this process just before event
    ``kill_at`` (1-based), after writing where it is into ``record`` (else the count, when the fit ends)."""
    import safetensors.torch
    import transformers.modeling_utils as modeling_utils

    import sgrpo.export as export
    import sgrpo.run.checkpoints as checkpoints
    import sgrpo.run.saving as saving

    state = {"count": 0, "inside": None, "events": [], "writes": 0}
    real_open = builtins.open

    def event(kind: str) -> None:
        if state["inside"] is None:
            return
        state["count"] += 1
        state["events"].append([state["writes"], state["inside"], kind])
        if state["count"] == kill_at:
            with real_open(record, "w") as f:
                f.write(json.dumps({"event": kill_at, "where": state["inside"], "before": kind}))
            os.kill(os.getpid(), signal.SIGKILL)

    def inside(name: str, function):
        def wrapped(*args, **kwargs):
            outer, state["inside"] = state["inside"], state["inside"] or name
            state["writes"] += outer is None
            try:
                return function(*args, **kwargs)
            finally:
                event(f"end of {name}")
                state["inside"] = outer

        return wrapped

    def counted(kind: str, function):
        def wrapped(*args, **kwargs):
            event(kind)
            return function(*args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def staged_export(*args, _original=export.staged_export, **kwargs):
        outer, state["inside"] = state["inside"], "export"
        state["writes"] += 1
        try:
            with _original(*args, **kwargs) as staged:
                yield staged
            event("end of export")
        finally:
            state["inside"] = outer

    def opening(function):
        def wrapped(file, mode="r", *args, **kwargs):
            if any(m in mode for m in "wax+"):
                event("open for writing")
            return function(file, mode, *args, **kwargs)

        return wrapped

    atomic = checkpoints.AtomicCheckpointIO
    atomic.save_checkpoint = inside("checkpoint", atomic.save_checkpoint)
    saving.link_checkpoint = inside("link", saving.link_checkpoint)
    export.staged_export = staged_export
    checkpoints._HashingWriter.write = counted("bytes", checkpoints._HashingWriter.write)
    for name in ("fsync", "replace", "link", "rename"):
        setattr(os, name, counted(name, getattr(os, name)))
    builtins.open = io.open = opening(builtins.open)
    modeling_utils.safe_save_file = counted("safetensors file", safetensors.torch.save_file)

    def at_exit() -> None:
        with real_open(record, "w") as f:
            f.write(json.dumps({"events": state["events"]}))

    import atexit

    atexit.register(at_exit)


def worker(argv: list[str]) -> None:
    kill_at, record, *rest = argv
    instrument(None if kill_at == "none" else int(kill_at), Path(record))
    from sgrpo.fit import main

    main(rest)


# ----------------------------------------------------------------------------------------- the trials
def run(command: list[str], log: Path) -> int:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        return subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def fit(root: Path, kill_at: int | None, record: Path, *extra: str) -> int:
    command = [sys.executable, "-m", "benchmarks.kill_trials", "--worker", "none" if kill_at is None else str(kill_at),
               str(record), *fit_args(root, *extra)]  # fmt: skip
    return run(command, root.parent / f"{root.name}.log")


def outcome(root: Path) -> tuple[dict, dict]:
    """The run's deterministic metrics by step (the report's reading of ``metrics.jsonl``: each step as its last
    start logged it) and its weights: ``hf_model/`` and ``last.ckpt``'s state dict."""
    import torch
    from safetensors.torch import load_file

    from sgrpo.eval.report import read_run_metrics

    metrics = {key: dict(rows) for key, rows in read_run_metrics(root).items()
               if "time" not in key and "throughput" not in key}  # fmt: skip
    weights = {f"hf_model/{k}": v for f in sorted((root / "hf_model").glob("*.safetensors")) for k, v in
               load_file(f).items()}  # fmt: skip
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    weights |= {f"last.ckpt/{k}": v for k, v in state["state_dict"].items()}
    weights["last.ckpt/global_step"] = torch.tensor(state["global_step"])
    return metrics, weights


def differences(got: tuple[dict, dict], want: tuple[dict, dict]) -> list[str]:
    import torch

    problems = []
    for key, rows in want[0].items():
        if got[0].get(key) != rows:
            missing = sorted(set(rows) - set(got[0].get(key, {})))
            problems.append(f"metric {key} differs" + (f" (steps {missing} missing)" if missing else ""))
    if set(got[1]) != set(want[1]):
        problems.append(f"other tensors: {sorted(set(got[1]) ^ set(want[1]))[:4]}")
    problems += [f"tensor {k} differs" for k in want[1] if k in got[1] and not torch.equal(got[1][k], want[1][k])]
    return problems


PLACES = ("export", "checkpoint", "link")


def draw(events: list[list], rng: random.Random, place: str | None = None) -> int:
    """The 1-based event to kill at: a write drawn at random (each checkpoint write, ``last.ckpt`` link and the
    export alike; of kind ``place`` if given), then one of its events; drawing over all events at once would
    almost always land in a checkpoint's bytes (``torch.save`` writes in many small chunks)."""
    writes = sorted({write for write, where, _ in events if place is None or where == place})
    write = rng.choice(writes)
    return rng.choice([i + 1 for i, (w, _, _) in enumerate(events) if w == write])


def trials(count: int, seed: int, workdir: Path, every_place: bool = False) -> list[dict]:
    """``count`` trials (after one uninterrupted reference run in ``workdir``); one result per trial. With
    ``every_place`` trial i kills in a write of kind ``PLACES[i % 3]``."""
    reference_root = workdir / "reference"
    assert fit(reference_root, None, workdir / "reference.json") == 0, f"see {workdir}/reference.log"
    events = json.loads((workdir / "reference.json").read_text())["events"]
    want = outcome(reference_root)
    rng, results = random.Random(seed), []
    for trial in range(count):
        root, record = workdir / f"trial{trial}", workdir / f"trial{trial}.json"
        kill_at = draw(events, rng, PLACES[trial % len(PLACES)] if every_place else None)
        killed = fit(root, kill_at, record) == -signal.SIGKILL and record.exists()
        where = json.loads(record.read_text()) if killed else {}
        leftovers = sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.name.endswith((".partial", ".old")))
        started_again = False
        status = fit(root, None, workdir / f"trial{trial}.resume.json", "--ckpt_path=last")
        refusal = (root.parent / f"{root.name}.log").read_text().rsplit("error: ", 1)[-1]
        if status == 2 and "start it again without --ckpt_path, with --overwrite true" in refusal:
            started_again = True  # killed before the first checkpoint was complete: as the refusal says
            status = fit(root, None, workdir / f"trial{trial}.again.json", "--overwrite=true")
        problems = [f"the resume exited {status}"] if status != 0 else differences(outcome(root), want)
        results.append({"trial": trial, "event": kill_at, "of": len(events), "killed": killed,
                        "where": where.get("where"), "before": where.get("before"), "leftovers": leftovers,
                        "started_again": started_again, "exact": not problems, "problems": problems[:5]})  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def summary(results: list[dict]) -> str:
    killed = [r for r in results if r["killed"]]
    places: dict[str, int] = {}
    for r in killed:
        places[r["where"]] = places.get(r["where"], 0) + 1
    exact = sum(r["exact"] for r in results)
    where = ", ".join(f"{n} in {w}" for w, n in sorted(places.items()))
    again = sum(r["started_again"] for r in results)
    unfinished = sum(bool(r["leftovers"]) for r in killed)
    return (f"{len(results)} trials: {len(killed)} killed mid-write ({where}), {unfinished} "
            f"left unfinished files; {again} had nothing to resume and started again with --overwrite true; {exact} of "
            f"{len(results)} ended exactly as the uninterrupted run (metrics and weights, bit for bit)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return
    from benchmarks import artefact

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (else a temporary folder)")
    parser.add_argument("--from-log", type=Path, default=None, help="publish the trials a run printed into FILE")
    args = artefact.publish_option(parser).parse_args(argv)
    started = time.monotonic()
    if args.from_log is not None:
        results = [json.loads(line) for line in args.from_log.read_text().splitlines() if line.startswith("{")]
        argv = ["--trials", str(len(results)), "--seed", str(args.seed)]  # the command that ran them
    else:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sgrpo-kill-trials-"))
        workdir.mkdir(parents=True, exist_ok=True)
        results = trials(args.trials, args.seed, workdir)
        if args.workdir is None:
            shutil.rmtree(workdir)
    line = summary(results)
    print(line, f"({time.monotonic() - started:.0f} s)")
    rows = [f"| {r['trial']} | {r['where']} | before {r['before']} | {r['event']} of {r['of']} | "
            f"{', '.join(r['leftovers']) or '-'} | {'yes' if r['started_again'] else '-'} | "
            f"{'yes' if r['exact'] else '; '.join(r['problems'])} |" for r in results]  # fmt: skip
    report = "\n".join(["# kill -9 during checkpoint and export writes, then --ckpt_path last", "", line, "",
                        "| trial | killed in | at | event | left unfinished | started again | exact |",
                        "|---|---|---|---|---|---|---|", *rows])  # fmt: skip
    result = {"trials": len(results), "killed": sum(r["killed"] for r in results),
              "exact": sum(r["exact"] for r in results), "summary": line, "each": results}  # fmt: skip
    artefact.publish_run(args, "kill_trials", result, report, __file__, argv, drop=())
    sys.exit(0 if all(r["exact"] for r in results) else 1)


if __name__ == "__main__":
    main()
