"""Checkpoint files that survive kills: atomic writes in the run folder, checksums, and a resume that skips broken
files. (``sgrpo.run.saving`` decides what is saved when.)

A checkpoint is written under a hidden name in its own folder (``.last.ckpt.partial``), flushed to disk
and renamed over the old one, so a kill at any instant leaves the previous checkpoint whole, and
``$TMPDIR`` is never used (Lightning's own save goes through a temporary file there, then a copy when
it is on another filesystem). Sharded (FSDP2) checkpoints are folders: the processes write a hidden
folder, then global rank 0 swaps it in (``replace_folder``; a kill between its two renames is undone by
``recover_swapped`` at the next start). A second name for the same state (``last.ckpt`` beside the periodic
``stepN.ckpt``) is a hard link, not a second write (``link_checkpoint``). ``--ckpt_path last`` takes the newest
*step* that loads (``resumable``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from sgrpo.run.resume import ProcessesDisagree

log = logging.getLogger(__name__)

#: hidden names of unfinished writes (``.last.ckpt.partial``) and of a folder being swapped out (``.old``)
PARTIAL, OLD = ".partial", ".old"
#: the file a fit's export holds (its run folder, step, base): only such a folder is replaced by a later export
EXPORT_MARK = "sgrpo_export.json"
CHECKSUM = ".sha256"  # beside a checkpoint file: the SHA-256 of its bytes as written (``.last.ckpt.sha256``)
_STEP_FILE = re.compile(r"step(\d+)\.ckpt")


def hidden_name(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file's ``write`` that feeds a SHA-256 of what it writes (``torch.save`` writes sequentially)."""

    def __init__(self, f) -> None:
        self.f, self.name, self.sha256 = f, f.name, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of checkpoint file ``path`` is recorded (``.NAME.sha256``, JSON)."""
    return hidden_name(path, CHECKSUM)


def record_checksum(path: Path, digest: str) -> None:
    """Record ``digest`` as that of the file about to replace ``path``, keeping the two before it: until the
    rename lands, the file in place is one of those, and matches."""
    record = checksum_path(path)
    earlier = recorded_checksums(path) or []
    partial = hidden_name(record, PARTIAL)
    with open(partial, "w") as f:
        json.dump({"sha256": [digest, *earlier[:2]]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, record)


def recorded_checksums(path: Path) -> list[str] | None:
    """The SHA-256 digests recorded for ``path`` (None: none recorded, as for a file sgrpo did not write)."""
    try:
        return list(json.loads(checksum_path(path).read_text())["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden file beside the target, ``fsync``, then ``os.replace`` over the target.

    The SHA-256 of the bytes written is recorded beside it (``.NAME.sha256``): a file whose bytes changed
    since (a flipped bit on disk, a copy gone wrong) is found at resume (``checkpoint_problem``) and skipped.

    A kill mid-write leaves the old checkpoint whole and a ``.NAME.partial`` file that the next run
    removes; a write that fails (a full disk) removes its own. Local paths only (sgrpo refuses remote checkpoint paths).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = hidden_name(path, PARTIAL)
        try:
            with open(partial, "wb") as f:
                hashing = _HashingWriter(f)
                torch.save(checkpoint, hashing)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk: free what the write took
            partial.unlink(missing_ok=True)
            raise
        record_checksum(path, hashing.sha256.hexdigest())
        os.replace(partial, path)
        _fsync_dir(path.parent)


def replace_folder(staged: Path, target: Path) -> None:
    """Put the folder ``staged`` at ``target`` (a file or folder that may exist), removing the old one.

    Two renames (``target`` -> ``.target.old``, ``staged`` -> ``target``): a kill between them leaves no
    ``target``, and both copies whole, which ``recover_swapped`` puts back before any cleaning."""
    old = hidden_name(target, OLD)
    remove_path(old)
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    _fsync_dir(target.parent)
    remove_path(old)


def link_checkpoint(source: Path, target: Path) -> None:
    """Make ``target`` hold checkpoint ``source`` (a file or a sharded folder) without writing it again: hard links
    (a copy of the bytes where the filesystem has none), swapped in as a write is, with ``source``'s checksum. Pruning
    ``source`` later leaves ``target`` whole; neither is ever written in place (every write is a new file)."""
    staged = hidden_name(target, PARTIAL)
    remove_path(staged)
    if source.is_dir():
        try:
            shutil.copytree(source, staged, copy_function=os.link)
        except OSError:  # no hard links on this filesystem (or across two): copy the bytes
            remove_path(staged)
            shutil.copytree(source, staged)
        replace_folder(staged, target)
        return
    try:
        os.link(source, staged)
    except OSError:
        shutil.copyfile(source, staged)
    digests = recorded_checksums(source)
    if digests:
        record_checksum(target, digests[0])
    os.replace(staged, target)
    _fsync_dir(target.parent)


def remove_path(path: Path) -> None:
    """Delete a file or a folder tree (nothing if it does not exist)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover_swapped(folder: Path) -> list[str]:
    """Put back a checkpoint whose swap (``replace_folder``) was cut between its two renames: ``NAME`` is gone, and
    ``.NAME.partial`` (the new copy, complete: it is swapped in only once written) and ``.NAME.old`` are left. The
    new copy if it loads, else the old one, becomes ``NAME`` again; one line per recovery."""
    recovered = []
    for old in folder.glob(f".*{OLD}") if folder.is_dir() else []:
        target = folder / old.name[1 : -len(OLD)]
        if target.exists():
            continue
        new = hidden_name(target, PARTIAL)
        source = new if new.exists() and not checkpoint_problem(new) else old
        os.replace(source, target)
        _fsync_dir(folder)
        which = "the new copy" if source == new else "the previous copy (the new one was incomplete)"
        recovered.append(f"recovered {target} from {which}, left by a swap that a kill cut short")
    return recovered


def remove_unfinished(folder: Path) -> list[Path]:
    """Delete what killed writes left in ``folder`` (``.*.partial``, ``.*.old``), once ``recover_swapped`` has put
    back a checkpoint they alone held; return what was removed."""
    for line in recover_swapped(folder):
        log.warning(line)
    leftovers = [p for p in folder.glob(".*") if p.name.endswith((PARTIAL, OLD))] if folder.is_dir() else []
    for path in leftovers:
        remove_path(path)
    return leftovers


#: a torch file that loads but was not written by Lightning (Lightning's restore would raise a KeyError)
NOT_LIGHTNING = "a torch file, but not a Lightning checkpoint (no pytorch-lightning_version)"


def checkpoint_problem(path: Path) -> str:
    """Why ``path`` cannot be resumed from ("" if it loads).

    A file is checked against its recorded SHA-256 (read once, in full) and opened as Lightning opens
    it, with its tensors memory-mapped; a sharded folder needs its metadata, Lightning's ``meta.pt`` and
    every shard it lists, long enough (its bytes are not checksummed).
    """
    try:
        if not path.is_dir():
            if not zipfile.is_zipfile(path):  # its index, written last, is missing
                return f"truncated, or not a checkpoint ({path.stat().st_size:,} bytes)"
            digests = recorded_checksums(path)
            if digests is not None and file_sha256(path) not in digests:
                return "corrupt: its SHA-256 is not that of the bytes written"
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


def checkpoint_step(path: Path) -> int | None:
    """The training step a checkpoint holds (its ``global_step``), read without its tensors (memory-mapped; a sharded
    folder's ``meta.pt``); None if it cannot be read."""
    try:
        if path.is_dir():
            checkpoint = torch.load(path / "meta.pt", map_location="cpu")
        else:
            checkpoint = torch.load(path, map_location="cpu", mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # truncated, not a checkpoint: checkpoint_problem says why
        return None


def resumable(folder: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint of ``folder`` that holds the newest step and loads, and one line per newer one skipped, saying
    why. Ranked by the step each holds, not by name: after a failed ``last.ckpt`` write, ``last.ckpt`` may hold an
    older step than a good ``stepN.ckpt``. At equal steps ``last.ckpt`` comes first (it is then a link to the
    other); one whose step cannot be read is tried first (and skipped, saying why)."""
    paths = [p for p in [folder / "last.ckpt", *numbered_checkpoints(folder)] if p.exists()]
    steps = {p: checkpoint_step(p) for p in paths}
    ranked = sorted(paths, key=lambda p: (math.inf if steps[p] is None else steps[p], p.name == "last.ckpt"))
    skipped = []
    for path in reversed(ranked):
        problem = checkpoint_problem(path)
        if not problem:
            return path, skipped
        skipped.append(f"skipped {path}: it does not load ({problem})")
    return None, skipped


def checkpoint_identity(path: Path) -> list:
    """What tells two views of a checkpoint apart without reading its bytes: each file's name, size and modification
    time (a sharded folder's every file), and the SHA-256 recorded when it was written. Processes that see other
    bytes under the same path (a stale NFS cache, another copy) see another identity."""
    try:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stats = [(str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns)
                 for f in files]  # fmt: skip
    except OSError as err:
        return [f"unreadable: {err.strerror}"]
    return [*stats, (recorded_checksums(path) or [None])[0]]


def numbered_checkpoints(folder: Path) -> dict[Path, int]:
    """The periodic checkpoints in ``folder`` (``stepN.ckpt``, files or sharded folders) and their steps N."""
    return {p: int(m.group(1)) for p in folder.glob("step*.ckpt") if (m := _STEP_FILE.fullmatch(p.name))}


def branched_checkpoints(folder: Path, step: int, resumed: Path) -> list[Path]:
    """The checkpoints of ``folder`` newer than ``step``, the step of ``resumed`` (the checkpoint a run resumed from):
    those of the run it branched from, ``last.ckpt`` too unless it is ``resumed`` (``--ckpt_path last`` would take
    the newest of them)."""
    newer = [path for path, n in numbered_checkpoints(folder).items() if n > step]
    last = folder / "last.ckpt"
    same = resumed.exists() and last.exists() and os.path.samefile(last, resumed)
    if last.exists() and not same and (checkpoint_step(last) or -1) > step:
        newer.append(last)
    return newer


def set_aside(folder: Path, paths: list[Path], step: int) -> Path:
    """``paths`` (checkpoints of ``folder``) and their checksums moved into ``folder/abandoned_stepS``, S = ``step``."""
    aside = folder / f"abandoned_step{step}"
    aside.mkdir(exist_ok=True)
    for item in (x for path in paths for x in (path, checksum_path(path))):
        if item.exists():
            os.replace(item, aside / item.name)
    return aside


def tidy_resumed(folder: Path, step: int, resumed: Path, keep: int, leader: bool, barrier) -> tuple[list[str], dict]:
    """A resume at ``step`` from ``resumed`` in ``folder``: the checkpoints newer than it (``branched_checkpoints``) set
    aside by the ``leader`` (with a warning), every process waiting for it (``barrier``); then the ``stepN.ckpt`` to
    delete (the oldest beyond ``keep`` when >= 0, never ``resumed``) and those kept (path: step)."""
    if leader and (newer := branched_checkpoints(folder, step, resumed)):  # the leader alone reads and moves them
        log.warning("resumed at step %d, before the newest checkpoints of this folder (%s): they are moved to %s, so "
                    "that --ckpt_path last continues this run", step, ", ".join(p.name for p in newer),
                    set_aside(folder, newer, step))  # fmt: skip
    barrier()
    steps = sorted(((str(p), n) for p, n in numbered_checkpoints(folder).items()), key=lambda item: item[1])
    cut = max(0, len(steps) - keep) if keep >= 0 else 0  # keep: save_top_k, -1 for all, 0 for only last.ckpt
    same = lambda path: resumed.exists() and os.path.samefile(path, resumed)  # noqa: E731
    return [path for path, _ in steps[:cut] if not same(path)], dict(steps[cut:])


def resume_failure(ckpt_path, exception: BaseException) -> str:
    """One line for a checkpoint that failed to load into this run (nothing is written after it)."""
    if isinstance(exception, ProcessesDisagree):
        return str(exception)
    return (
        f"--ckpt_path {ckpt_path} does not load into this run ({load_error(exception)}); it was "
        "left as it was. Resume with the config that wrote it (model, model.peft, model.optimizer), or start "
        "a fresh run in another --trainer.default_root_dir"
    )


def evaluation_load_failure(ckpt_path, exception: BaseException) -> str:
    """One line for a checkpoint that ``validate`` or ``test`` could not load into the configured model."""
    return (
        f"--ckpt_path {ckpt_path} does not load into model.model ({load_error(exception)}): evaluate it with the "
        "config that trained it (model.model, model.peft), or export it (python -m sgrpo.export CKPT OUT) and "
        "evaluate OUT with --model.model=OUT"
    )


def load_error(exception: BaseException) -> str:
    """``Type: first line`` of a load error; where that line only heads a list (``load_state_dict``'s "Error(s) in
    loading state_dict for X:"), with the list's first entry (the first missing key or size mismatch)."""
    lines = [line.strip() for line in str(exception).splitlines() if line.strip()]
    message = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(exception).__name__}: {message}".rstrip(": ")
