"""Where a quickstart step's time goes, trainer and producer, for ``benchmarks/async_rollouts.py``.

    python -m benchmarks._async_probe OUT.json <sgrpo.fit arguments>

Runs ``sgrpo.fit`` in this process with timers around the trainer's phases and writes ``OUT.json``:

* ``phases``: per phase, mean wall and CPU seconds (``time.thread_time``: the calling thread's) per call over
  steps 2 on: ``sample`` (generation; async: taking the producer's block), ``score``, ``proximal_forward`` (the
  no-grad forward of the update's starting log-probs), ``update`` (all of the update, the proximal forward
  included), ``push`` (the weights to the producer), ``log`` (the step's metrics), ``step`` (all of
  ``training_step``);
* ``trainer_cpu_s`` / ``producer_cpu_s``: CPU seconds per step of the trainer process (every thread of it:
  ``time.process_time``) and of its producer process (``/proc/<pid>/stat``), from the start of step 2 to the
  end of the last step, validation intervals left out of the trainer's (the producer's share during them is
  small: admission stops it at most S steps ahead), and ``loop_s``, the wall seconds per step over the same
  intervals (Lightning's loop included).

CPU seconds do not grow when other jobs load the machine the way wall seconds do, so ``trainer_cpu_s`` and
``producer_cpu_s`` give what one step needs of each process's core: on a machine with a free core for each, an
async step takes about max(trainer, producer), a synchronous one its trainer's (sampling included).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

#: steps left out at the start (step 0 holds the producer's start, step 1 its first weight copy)
SKIP = 2


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``); 0 where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def instrument() -> tuple[dict, list]:
    """Wrap the trainer's phases with timers; returns (per-phase [(wall, cpu)] lists, per-step marks)."""
    from sgrpo.policy import GRPOPolicy
    from sgrpo.train.asynchronous import AsyncRollouts
    from sgrpo.train.collect import GroupCollection
    from sgrpo.train.update import PolicyUpdate

    timings: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    marks: list[dict] = []

    def timed(cls, method: str, phase: str) -> None:
        inner = getattr(cls, method)

        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                timings[phase].append((time.perf_counter() - wall, time.thread_time() - cpu))

        setattr(cls, method, wrapper)

    for cls, method, phase in (
        (GroupCollection, "sample", "sample"), (GroupCollection, "score", "score"),
        (PolicyUpdate, "_logprobs", "proximal_forward"), (PolicyUpdate, "update", "update"),
        (AsyncRollouts, "push_weights", "push"), (GRPOPolicy, "_log_step", "log"),
        (GRPOPolicy, "training_step", "step"),
    ):  # fmt: skip
        timed(cls, method, phase)
    step = GRPOPolicy.training_step

    def marked(self, *args, **kwargs):
        marks.append(mark(self, "start"))
        try:
            return step(self, *args, **kwargs)
        finally:
            marks.append(mark(self, "end"))

    GRPOPolicy.training_step = marked
    return timings, marks


def mark(policy, kind: str) -> dict:
    producer = getattr(policy, "_producer", None)
    return {"kind": kind, "wall": time.perf_counter(), "cpu": time.process_time(),
            "producer": process_cpu_s(producer.process.pid) if producer is not None else 0.0}  # fmt: skip


def per_step(marks: list[dict]) -> dict[str, float]:
    """Trainer CPU, producer CPU and loop wall seconds per step from step ``SKIP`` on: the trainer's summed over
    the intervals from one step's start to the next's that held no validation (no longer than 3x the median)."""
    starts = [m for m in marks if m["kind"] == "start"][SKIP:]
    ends = [m for m in marks if m["kind"] == "end"]
    if len(starts) < 2:
        return {"trainer_cpu_s": 0.0, "producer_cpu_s": 0.0, "loop_s": 0.0, "steps": 0}
    spans = [(a, b) for a, b in zip(starts, starts[1:])]
    typical = statistics.median(b["wall"] - a["wall"] for a, b in spans)
    kept = [(a, b) for a, b in spans if b["wall"] - a["wall"] <= 3 * typical]  # validations are far longer
    producer = (ends[-1]["producer"] - starts[0]["producer"]) / (len(marks) // 2 - SKIP)
    return {"trainer_cpu_s": statistics.fmean(b["cpu"] - a["cpu"] for a, b in kept),
            "loop_s": statistics.fmean(b["wall"] - a["wall"] for a, b in kept),
            "producer_cpu_s": producer, "steps": len(kept)}  # fmt: skip


def main(argv: list[str]) -> dict:
    out, args = Path(argv[0]), argv[1:]
    timings, marks = instrument()
    from sgrpo.fit import main as fit

    fit(args)
    import torch

    phases = {name: {"wall_s": statistics.fmean(w for w, _ in values[SKIP:] or values),
                     "cpu_s": statistics.fmean(c for _, c in values[SKIP:] or values)}
              for name, values in timings.items()}  # fmt: skip
    result = {"phases": phases, **per_step(marks), "threads": torch.get_num_threads()}
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


if __name__ == "__main__":  # a producer's fork server imports this module again: nothing runs then
    main(sys.argv[1:])
