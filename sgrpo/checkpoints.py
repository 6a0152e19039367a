"""Checkpoints that survive kills: atomic writes in the run folder, pruning, and a resume that skips broken files.

A checkpoint is written under a hidden name in its own folder (``.last.ckpt.partial``), flushed to disk
and renamed over the old one, so a kill at any instant leaves the previous checkpoint whole, and
``$TMPDIR`` is never used (Lightning's own save goes through a temporary file there, then a copy when
it is on another filesystem). Sharded (FSDP2) checkpoints are folders: the processes write a hidden
folder, then global rank 0 swaps it in.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)

#: hidden names of unfinished writes (``.last.ckpt.partial``) and of a folder being swapped out (``.old``)
PARTIAL, OLD = ".partial", ".old"
_STEP_FILE = re.compile(r"step(\d+)\.ckpt")


def _hidden(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden file beside the target, ``fsync``, then ``os.replace`` over the target.

    A kill mid-write leaves the old checkpoint whole and a ``.NAME.partial`` file that the next run
    removes. Local paths only (sgrpo refuses remote checkpoint paths).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = _hidden(path, PARTIAL)
        with open(partial, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        _fsync_dir(path.parent)


def replace_folder(staged: Path, target: Path) -> None:
    """Put the folder ``staged`` at ``target`` (a file or folder that may exist), removing the old one."""
    old = _hidden(target, OLD)
    remove_path(old)
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    _fsync_dir(target.parent)
    remove_path(old)


def remove_path(path: Path) -> None:
    """Delete a file or a folder tree (nothing if it does not exist)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def remove_unfinished(folder: Path) -> list[Path]:
    """Delete what killed writes left in ``folder`` (``.*.partial``, ``.*.old``); return what was removed."""
    leftovers = [p for p in folder.glob(".*") if p.name.endswith((PARTIAL, OLD))] if folder.is_dir() else []
    for path in leftovers:
        remove_path(path)
    return leftovers


#: a torch file that loads but was not written by Lightning (Lightning's restore would raise a KeyError)
NOT_LIGHTNING = "a torch file, but not a Lightning checkpoint (no pytorch-lightning_version)"


def checkpoint_problem(path: Path) -> str:
    """Why ``path`` cannot be resumed from ("" if it loads).

    A file is opened as Lightning opens it, with its tensors memory-mapped (so a large file costs
    little); a sharded folder needs its metadata, Lightning's ``meta.pt`` and every shard it lists,
    long enough.
    """
    try:
        if not path.is_dir():
            if not zipfile.is_zipfile(path):  # its index, written last, is missing
                return f"truncated, or not a checkpoint ({path.stat().st_size:,} bytes)"
            checkpoint = torch.load(path, map_location="cpu", mmap=True)
            return "" if isinstance(checkpoint, dict) and "pytorch-lightning_version" in checkpoint else NOT_LIGHTNING
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path)).read_metadata()
        for info in metadata.storage_data.values():
            shard = path / info.relative_path
            if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                return f"shard {info.relative_path} is missing or truncated"
        torch.load(path / "meta.pt", map_location="cpu")
    except Exception as err:  # any failure to open means: not resumable, say why
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
    return ""


def resumable(folder: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of ``folder`` that loads (``last.ckpt``, then ``stepN.ckpt`` from the highest N),
    and one line per newer checkpoint skipped, saying why."""
    steps = sorted((p for p in folder.glob("step*.ckpt") if _STEP_FILE.fullmatch(p.name)), key=_step, reverse=True)
    skipped = []
    for path in [folder / "last.ckpt", *steps]:
        if not path.exists():
            continue
        problem = checkpoint_problem(path)
        if not problem:
            return path, skipped
        skipped.append(f"skipped {path}: it does not load ({problem})")
    return None, skipped


def _step(path: Path) -> int:
    return int(_STEP_FILE.fullmatch(path.name).group(1))


class RunCheckpoint(ModelCheckpoint):
    """sgrpo's checkpoints: ``last.ckpt`` (after every save, on an exception, at the end of fit) and
    ``stepN.ckpt`` every ``checkpoint_every`` training steps, of which the newest ``keep_last`` are kept
    (None: all; 0: none, only ``last.ckpt``).

    ``last.ckpt`` is always this run's latest state: an interrupted or crashed run (SIGTERM, Ctrl-C, an
    exception) saves it at its last completed step, a finished run at its final step, and a file of
    the same name is replaced, never versioned (``last-v1.ckpt``). (With several optimiser steps per
    training step, an interruption inside the update saves the steps taken so far.) Writes are atomic
    (``AtomicCheckpointIO``; sharded folders are written hidden and swapped in).
    """

    def __init__(self, dirpath: str | None = None, checkpoint_every: int = 50, keep_last: int | None = 3) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 training steps, got {checkpoint_every}")
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps only last.ckpt) or null (keep all), got {keep_last}")
        super().__init__(
            dirpath=dirpath,
            filename="step{step}",
            monitor="step",  # "the highest steps" are the newest: save_top_k keeps the last N
            mode="max",
            save_top_k=-1 if keep_last is None else keep_last,
            every_n_train_steps=checkpoint_every,
            save_last=True,
            save_on_exception=True,
            auto_insert_metric_name=False,
            enable_version_counter=False,
        )

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning warns that the folder "exists and is not empty": a resume's is, and a fresh run into a
        folder holding another run is refused before this (``sgrpo.runs``)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Save ``last.ckpt`` at the last completed step (not a numbered checkpoint outside ``keep_last``)."""
        if self._should_save_on_exception(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """The periodic checkpoints, and ``last.ckpt`` after the final step.

        The final one is saved here, like the periodic ones, rather than after the validation that may
        follow: Lightning resumes from a checkpoint saved after that validation one logged step late.
        """
        with warnings.catch_warnings():  # "the checkpoint will contain the model state AFTER optimization":
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")  # wanted
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if 0 < trainer.max_steps <= trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        """Save ``last.ckpt`` where a fit ended before ``max_steps`` (a callback stopped it), unless just saved."""
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # Lightning's ModelParallelStrategy writes a sharded checkpoint as a folder, in place and from
        # every process: write it under a hidden name, then swap it in from global rank 0.
        if not getattr(trainer.strategy, "_save_distributed_checkpoint", False):
            return super()._save_checkpoint(trainer, filepath)
        staged = _hidden(Path(filepath), PARTIAL)
        super()._save_checkpoint(trainer, str(staged))
        if trainer.is_global_zero:
            replace_folder(staged, Path(filepath))
        trainer.strategy.barrier("RunCheckpoint.replace_folder")
        self._last_checkpoint_saved = filepath
