"""Run folders: one run per folder, one process at a time, and exit codes that schedulers read right.

A run folder (``trainer.default_root_dir``) belongs to one run. A fresh run into a folder that
already holds one is refused (``--overwrite true`` deletes the old run's outputs first), so
``--ckpt_path last`` always means this run's latest checkpoint. While a fit runs, it holds an
exclusive lock on ``<run>/.sgrpo.lock`` (``fcntl.flock``; the file says which process holds it); a
second fit into the folder is refused. Under DDP / FSDP only global rank 0 does any of this: before
Lightning's launcher starts the other processes, or, where srun or torchrun started them all, with every
process waiting for its decision (a refusal ends them all in seconds).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sgrpo.checks import ConfigError
from sgrpo.run.checkpoints import (
    checkpoint_identity,
    link_checkpoint,
    numbered_checkpoints,
    remove_path,
    remove_unfinished,
    resumable,
)
from sgrpo.run.resume import ProcessesDisagree, content_disagreement

log = logging.getLogger(__name__)

#: what a run writes into its folder; their presence means the folder holds a run
RUN_OUTPUTS = (
    "checkpoints", "lightning_logs", "metrics.jsonl", "completions.jsonl", "hf_model", "report.md", "curves.png"
)
LOCK_FILE = ".sgrpo.lock"
FRESH = "run without --ckpt_path to start fresh (with --overwrite true if the folder holds a run)"

_held: list[IO[str]] = []  # lock files this process holds


def _close_held_locks() -> None:
    # A forked child (a reward worker) must not keep the run locked after its parent dies: a flock
    # lasts while any process holds the open file.
    for handle in _held:
        handle.close()
    _held.clear()


os.register_at_fork(after_in_child=_close_held_locks)


class RunRefused(Exception):
    """A run that must not start as asked; the message names the folder, the reason and the fixes."""


def run_folder(root: str | os.PathLike | None) -> Path:
    """``trainer.default_root_dir`` as a folder; an empty name is refused (it meant the working directory, where
    ``--overwrite true`` would delete what is there)."""
    if root is None or not str(root).strip():
        raise ConfigError(
            f"trainer.default_root_dir={root!r} names no folder (the run would be written into the working "
            "directory): give the run its own folder, e.g. --trainer.default_root_dir=runs/NAME"
        )
    return Path(root)


def lock_run(root: Path) -> IO[str]:
    """An exclusive lock on ``root`` for this process (released when the handle closes or the process dies)."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the run: the lock lives with it)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunRefused(
            f"{root} is in use by {holder}; wait for that run to end, or use another --trainer.default_root_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held.append(handle)
    return handle


def unlock_run(handle: IO[str]) -> None:
    """Release a lock taken by ``lock_run``, emptying the file first: it no longer names this process.

    The file itself stays: removing it could let two runs lock two different files of the same name (one
    opened before the removal, one after); an empty file names no holder.
    """
    _held.remove(handle)
    handle.truncate(0)
    handle.flush()
    handle.close()


class AgreedCheckpoint(os.PathLike):
    """``--ckpt_path last`` as global rank 0 resolved and verified it, the one checkpoint every process resumes.

    The other processes leave ``"last"`` unresolved (reading and hashing every candidate on each was 25 GB per
    process for a 1.5B model with AdamW) and take rank 0's path once the process group exists (``agree``, from
    ``RunCheckpoint.setup``, before anything loads): Lightning's DDP strategy does not broadcast it, and a process
    that resolved it alone could pick another file (a stale network-filesystem cache, a read error that fell back
    to ``stepN.ckpt``) and resume other optimiser moments, data position and counters. Lightning reads the path
    (``os.fspath``) only when it loads the checkpoint, after ``agree``.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __fspath__(self) -> str:
        if self.path is None:
            raise RuntimeError("--ckpt_path last read before global rank 0's decision reached this process")
        return self.path

    def __str__(self) -> str:
        return self.path or "last"

    def __repr__(self) -> str:
        return f"AgreedCheckpoint({self.path!r})"


def agree_checkpoint(trainer, ckpt_path, action: str = "resume", experiment: dict[str, str] | None = None) -> None:
    """Every process resumes the checkpoint global rank 0 chose, and sees the same bytes there: rank 0's path (of an
    ``AgreedCheckpoint``) is broadcast, then each process's view of the file (``checkpoint_identity``) compared with
    rank 0's; a difference raises ``ProcessesDisagree`` on every process, before anything loads. With a fit's
    ``experiment`` record (``sgrpo.run.resume``), resuming or not, the content each process sees at the model and
    data paths is compared the same way (``content_disagreement``). A collective."""
    if trainer.world_size < 2:
        return
    import torch.distributed as dist

    if experiment is not None:
        records: list = [None] * trainer.world_size
        dist.all_gather_object(records, experiment)
        if problem := content_disagreement(records):
            raise ProcessesDisagree(problem)
    if ckpt_path is None:
        return
    if isinstance(ckpt_path, AgreedCheckpoint):
        ckpt_path.path = trainer.strategy.broadcast(ckpt_path.path, src=0)
    seen: list = [None] * trainer.world_size
    dist.all_gather_object(seen, checkpoint_identity(Path(ckpt_path)))
    differ = [str(rank) for rank, view in enumerate(seen) if view != seen[0]]
    if differ:
        processes = f"process{'es' if len(differ) > 1 else ''} {', '.join(differ)}"
        raise ProcessesDisagree(
            f"--ckpt_path {ckpt_path}: {processes} see{'s' if len(differ) == 1 else ''} other bytes there than "
            f"process 0 (size, modification time or checksum differ: a stale network-filesystem cache, another "
            f"copy of the run folder, or a checkpoint written meanwhile), so they would {action} another state; "
            f"nothing was loaded. Make every process see the same {Path(ckpt_path).parent.parent}, then {action}"
        )


def prepare_run(root: Path, ckpt_path: str | None, overwrite: bool, leader: bool) -> str | AgreedCheckpoint | None:
    """The checkpoint to resume from (``"last"`` resolved), after the checks of a run folder.

    Only the ``leader`` (global rank 0) removes unfinished checkpoint writes (after putting back a checkpoint a cut
    swap left hidden), refuses, or with ``overwrite`` clears, a folder that holds another run, and resolves
    ``"last"`` (reading and checking the file); the others learn its decision once the processes are connected
    (``AgreedCheckpoint``).
    """
    folder = root / "checkpoints"
    if leader:
        for path in remove_unfinished(folder):
            log.info("removed %s, left by a write that did not finish", path)
    held = [name for name in RUN_OUTPUTS if _holds_output(root / name)] if leader else []
    if ckpt_path == "last":
        hint = _start_again(root, held) if held else FRESH
        return AgreedCheckpoint(_relinked_last(folder, latest_checkpoint(folder, hint)) if leader else None)
    resuming = ckpt_path is not None and Path(ckpt_path).resolve().is_relative_to(folder.resolve())
    if not leader or not held or resuming:
        return ckpt_path
    if not overwrite and not _has_checkpoint(folder):  # killed during its first checkpoint write: nothing to resume
        raise RunRefused(f"{root} already holds a run ({', '.join(held)}) but no checkpoint of it (it stopped "
                         f"before its first was complete): nothing to resume; {_start_again(root, held)}")  # fmt: skip
    if not overwrite:
        raise RunRefused(
            f"{root} already holds a run ({', '.join(held)}): resume it with --ckpt_path last, start this one "
            f"in another folder with --trainer.default_root_dir=..., or delete the old run with --overwrite true"
        )
    for name in held:
        path = root / name
        log.warning("--overwrite: deleting %s", path)
        remove_path(path)
    return ckpt_path


def _relinked_last(folder: Path, path: str) -> str:
    """``path``, the newest checkpoint that loads; ``last.ckpt`` made to hold it when it is another (a kill cut the
    ``last.ckpt`` link or write short): else a fit resumed at ``max_steps`` saves nothing, and ``last.ckpt`` stayed
    older than the run."""
    last = folder / "last.ckpt"
    if Path(path) != last:
        link_checkpoint(Path(path), last)
        log.warning("%s now holds %s again (a kill had cut its write or link short)", last, Path(path).name)
    return path


def _has_checkpoint(folder: Path) -> bool:
    """``folder`` (a run's ``checkpoints/``) holds a finished checkpoint write (``last.ckpt`` or ``stepN.ckpt``),
    loadable or not; unfinished writes are removed before this is asked."""
    return (folder / "last.ckpt").exists() or bool(numbered_checkpoints(folder))


def _start_again(root: Path, held: list[str]) -> str:
    """The way out of a run folder with nothing to resume that holds the outputs ``held``: start it again."""
    return (f"start it again without --ckpt_path, with --overwrite true (deletes {', '.join(held)} in {root}), or "
            "start in another folder with --trainer.default_root_dir=...")  # fmt: skip


def _holds_output(path: Path) -> bool:
    """``path`` (one of ``RUN_OUTPUTS``) holds something of a run. A ``lightning_logs`` folder with nothing but
    configs holds none: those of starts that stopped before their first step (a configuration refused once the
    processes existed, a model that did not load)."""
    if path.name != "lightning_logs":
        return path.exists()
    return any(f.is_file() and f.name not in ("config.yaml", "hparams.yaml") for f in path.rglob("*"))


def logger_versions(root: Path, name: str) -> list[Path]:
    """``root/lightning_logs/version_N/<name>`` for every N that has one, oldest first."""

    def number(path: Path) -> int:
        suffix = path.parent.name.removeprefix("version_")
        return int(suffix) if suffix.isdigit() else -1

    return sorted(root.glob(f"lightning_logs/version_*/{name}"), key=number)


def latest_checkpoint(folder: Path, hint: str = FRESH) -> str:
    """``--ckpt_path last``: the newest checkpoint of ``folder`` that loads, saying which newer ones it skipped;
    ``RunRefused`` (ending with ``hint``) when none does."""
    path, skipped = resumable(folder)
    for line in skipped:
        log.warning(line)
    if path is None:
        found = f"no checkpoint in {folder} loads ({'; '.join(skipped)})" if skipped else f"{folder} has none"
        raise RunRefused(f"--ckpt_path last: {found}; {hint}")
    if skipped:
        log.warning("resuming from %s", path)
    return str(path)


@contextmanager
def claimed_run(
    root: Path,
    ckpt_path: str | None,
    overwrite: bool,
    leader: bool,
    agree: Callable[[str | None], str | None] | None = None,
) -> Iterator[str | AgreedCheckpoint | None]:
    """``prepare_run`` under the folder's lock (taken by the leader), held until the block ends.

    ``agree(refusal)`` turns this process's refusal (``RunRefused``'s message, or None) into the one every process
    acts on (``sgrpo.distributed.first_refusal``): where the launcher started every process, those the leader's
    refusal leaves waiting must stop too."""
    lock, refusal, resolved = None, None, None
    try:
        try:
            lock = lock_run(root) if leader else None
            resolved = prepare_run(root, ckpt_path, overwrite, leader)
        except RunRefused as err:
            refusal = str(err)
        except Exception as err:  # raised here; the others, waiting for this process's answer, stop with its line
            if agree is not None:
                agree(f"a process could not prepare {root} ({type(err).__name__}: {err})")
            raise
        refusal = refusal if agree is None else agree(refusal)
        if refusal is not None:
            raise RunRefused(refusal)
        yield resolved
    finally:
        if lock is not None:
            unlock_run(lock)


def launches_run(trainer) -> bool:
    """Whether this process is global rank 0 of the run, known before any process group exists.

    Lightning starts the other local processes by running the same command with ``LOCAL_RANK`` set;
    SLURM and torchrun start them all with their ranks in the environment. Each cluster environment
    reads those variables directly.
    """
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return environment is None or (environment.node_rank() == 0 and environment.local_rank() == 0)


class SignalExit(Callback):
    """Records the exit status an interrupted fit owes its scheduler: 143 after SIGTERM, 130 after Ctrl-C.

    A stop at a step's end (``sgrpo.run.faults.Stopped``) carries its own; Lightning exits 1 after a second
    Ctrl-C, and 0 after a SIGTERM it handles itself (before training starts), which SLURM reads as success.
    """

    def __init__(self) -> None:
        self.status: int | None = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self.status = 128 + signal.SIGTERM
        elif isinstance(exception, KeyboardInterrupt):
            self.status = 128 + signal.SIGINT
