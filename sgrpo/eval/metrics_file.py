"""The run's own metrics file, ``<run folder>/metrics.jsonl``: what the report draws, whatever logger the run uses.

Lightning hands every logged step to each of the trainer's loggers; ``MetricsFile`` is one of them, added by
``sgrpo.fit`` next to the logger the run chose (CSV by default, TensorBoard, W&B, or none). Global rank 0
appends one JSON object per logged step, ``{"step": N, "train/reward": ..., ...}``, and never rewrites the
file: a resumed run extends it. A fit resumed from a checkpoint first appends ``{"resumed_at": S}``, S the first
training step it logs, which supersedes what the earlier starts logged at steps S and later (a validation's at
step S, of the checkpoint's own weights, stands): a resume from an older checkpoint (after a kill) logs those
steps again, and the curves show each step once, from the start that continued. A line cut short by a kill, or
damaged (not UTF-8, not a JSON object of numbers), is skipped when the file is read, and counted in a warning.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

METRICS_FILE = "metrics.jsonl"
RESUMED_AT = "resumed_at"
VALIDATION = "val/"  # the validation's keys (sgrpo.eval.evaluation), logged at the step count of the weights it scored

Series = dict[str, list[tuple[int, float]]]

log = logging.getLogger(__name__)


class MetricsFile(Logger):
    """A Lightning logger that appends every logged step to ``<root>/metrics.jsonl`` (global rank 0 only)."""

    def __init__(self, root: str | Path) -> None:
        super().__init__()
        self.path = Path(root) / METRICS_FILE
        self._line_started = False  # whether this process checked that the file ends with a whole line
        self._resuming: int | bool | None = None  # True, or the step this start resumed at, until written

    @property
    def name(self) -> str:
        return "sgrpo"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the resolved config is Lightning's ``config.yaml``."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values = {key: float(value) for key, value in metrics.items() if key != "epoch"}
        if not values:
            return
        if self._resuming is not None:  # this start's first record: what the earlier starts logged from here is stale
            self._append({RESUMED_AT: step if self._resuming is True else self._resuming})
            self._resuming = None
        self._append({"step": step, **values})

    def mark_resume(self, step: int | None = None) -> None:
        """This start resumed from a checkpoint at training step ``step`` (default: its first logged step): that
        step and later ones supersede what earlier starts logged there."""
        self._resuming = True if step is None else step

    def _append(self, record: dict[str, Any]) -> None:
        append_lines(self.path, [json.dumps(record)], check_end=not self._line_started)
        self._line_started = True


def append_lines(path: Path, lines: list[str], check_end: bool = True) -> None:
    """Append ``lines`` (each a JSON record) to ``path``; with ``check_end``, first end a line a kill left cut short
    (the file not ending with a newline), so that the new records stay whole, each on its own line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        end = f.seek(0, 2)
        if check_end and end and (f.seek(end - 1), f.read(1))[1] != b"\n":
            f.write(b"\n")
        f.write("".join(line + "\n" for line in lines).encode())


class MarkResume(Callback):
    """Appends the resume record of ``MetricsFile`` when a fit starts from a checkpoint."""

    def __init__(self, metrics: MetricsFile) -> None:
        self.metrics = metrics

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.ckpt_path is not None:  # its first training step logs at rollout_step, as does a validation
            self.metrics.mark_resume(pl_module.rollout_step)  # the checkpoint owed (of its weights), redone first


def read_metrics_file(path: Path) -> Series:
    """``metrics.jsonl`` as ``{key: [(step, value), ...]}``, each step once (see the module docstring).

    A line that is not a record (cut short by a kill, or damaged: not UTF-8, not a JSON object, a value that
    is not a number) is skipped; a warning counts the skipped lines and names the first.
    """
    records, bad = [], []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        record = parse_record(line)
        if record is None:
            bad.append(number)
        else:
            records.append(record)
    if bad:
        log.warning("%s: skipped %d damaged line%s (line %d first)", path, len(bad), "s"[: len(bad) > 1], bad[0])
    return merge_records(records)


def parse_record(line: bytes) -> dict[str, float] | None:
    """One line of the file as a record, or None if it is not one: a JSON object whose values are numbers (NaN
    and infinity included: a diverged metric is a point, not damage), its ``step`` or ``resumed_at`` a whole
    number >= 0."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not record:
        return None
    if not all(isinstance(v, (int, float)) or (k == "step" and v is None) for k, v in record.items()):
        return None
    for key in ("step", RESUMED_AT):
        value = record.get(key)
        if value is not None and not (math.isfinite(value) and value == int(value) and value >= 0):
            return None
    return record


def merge_records(records: Iterable[Mapping[str, Any]]) -> Series:
    """Per-step records in the order written, merged: a later value of a key at a step replaces an earlier one,
    and ``{"resumed_at": S}`` drops every earlier point at step S or later, but a validation's at step S: it
    scored the weights after S steps, the checkpoint the resume starts from (``--validate_last``'s, which no
    resume runs again, was lost when the run was extended); one the checkpoint owed runs again and replaces it."""
    merged: dict[str, dict[int, float]] = defaultdict(dict)
    for record in records:
        if RESUMED_AT in record:
            start = int(record[RESUMED_AT])
            for key, points in merged.items():
                for step in [s for s in points if s > start or (s == start and not key.startswith(VALIDATION))]:
                    del points[step]
            continue
        step = int(record.get("step") or 0)
        for key, value in record.items():
            if key != "step":
                merged[key][step] = float(value)
    return {key: sorted(points.items()) for key, points in merged.items() if points}
