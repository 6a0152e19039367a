"""What a fault does to a run: a signal stops it at a step's end, one process's error ends every process.

**Signals.** During training, SIGTERM and the first Ctrl-C are recorded, not raised (``StopRequests``):
the step under way runs to its end, ``RunCheckpoint`` saves ``last.ckpt`` there (the only state a resume
continues exactly) and ``Stopped`` ends the fit with 143 or 130. A signal during a validation stops at
the end of that validation's current batch; the checkpoint then holds the step before it and the
validation runs again on resume. The processes agree on the stop (one all-reduce per step and per
validation batch), so they all save at the same step: the save is a collective under FSDP2. A second
Ctrl-C stops at once (``KeyboardInterrupt``), saving only where the state is a step's end. Under
Lightning's own launcher the first process forwards SIGTERM to the others, as Lightning does.

**Errors.** An error that one process raises alone (an out-of-memory, a bug, a peer lost) leaves the
others waiting in their next collective: on NCCL for the 30-minute collective timeout, holding every
GPU. So with more than one process, ``fail_fast`` prints the error and its traceback, names the process,
tells the others through the process group's store (each process watches it: ``AbortWatch``), kills the
processes Lightning's launcher started from this one, and ends this process with ``os._exit`` at once:
no checkpoint save, teardown or interpreter exit, which are collectives or may wait on one. Every other
process sees the notice within a second and ends likewise (or is ended by its launcher: torchrun and
Lightning's launcher kill the others when one exits non-zero). Errors that every process raises at
the same point (``EVERY_PROCESS``: a refused configuration, a refused resume, rewards failing step after
step, an agreed stop) take the ordinary path, and may save.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sgrpo.checks import ConfigError
from sgrpo.run.guards import GuardError
from sgrpo.run.resume import ResumeError

ABORT_KEY, FAILURES_KEY = "sgrpo/abort", "sgrpo/failures"  # in the process group's store


class Stopped(SystemExit):
    """A fit stopped by SIGTERM (exit 143) or Ctrl-C (130) at a step's end, ``last.ckpt`` saved there."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


#: errors that every process raises at the same point of the run (agreed through collectives or by construction)
EVERY_PROCESS = (Stopped, ConfigError, ResumeError, GuardError)


#: errors of the disk the run writes to: full, over quota, read-only
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def disk_fault(exception: BaseException) -> OSError | None:
    """The disk error behind ``exception`` (itself, or one it was raised from or while handling), else None.

    A full disk during ``torch.save`` surfaces as torch's RuntimeError raised while handling the OSError."""
    seen: BaseException | None = exception
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_ERRORS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def exit_status(exception: BaseException) -> int:
    """The exit status a scheduler should read for ``exception``: 143 SIGTERM, 130 Ctrl-C, else 1."""
    if isinstance(exception, SIGTERMException):
        return 128 + signal.SIGTERM
    if isinstance(exception, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


class StopRequests:
    """SIGTERM and the first Ctrl-C recorded while installed (from the main thread), to stop at a step's end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._forward: Callable[[int], None] | None = None

    def install(self, forward: Callable[[int], None] | None = None) -> None:
        """Take over SIGTERM and SIGINT; ``forward(signum)`` passes a SIGTERM on (to the processes this one started)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.signum, self._forward = None, forward
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signum is not None:
            return
        self.signum = signum
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
        print(f"\n{name}: stopping at the end of this step, after saving last.ckpt{again}", file=sys.stderr)
        if signum == signal.SIGTERM and self._forward is not None:
            self._forward(signum)

    def agreed(self, device: torch.device) -> int | None:
        """The signal any process received (a collective with more than one process), else None."""
        signum = self.signum or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            value = torch.tensor(float(signum), device=device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            signum = int(value.item())
        return signum or None


def _store():
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # no process group, or a torch without it: the launchers still end the others
        return None


class AbortWatch:
    """A thread that ends this process once another one has failed (``fail_fast``), checking every ``period`` s."""

    def __init__(self, rank: int, period: float = 0.5) -> None:
        self.rank, self.period = rank, period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        store = _store()
        if store is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, args=(store,), name="sgrpo-abort-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, store) -> None:
        lost = 0
        while not self._stop.wait(self.period):
            try:
                failed = store.check([ABORT_KEY])
                notice = store.get(ABORT_KEY).decode() if failed else ""
                lost = 0
            except Exception:  # the store lives in process 0: gone, unless the run is ending
                lost += 1
                if lost < 3 or self._stop.is_set() or not torch.distributed.is_initialized():
                    continue
                notice = "process 0 is gone (the process group's store does not answer)"
            if notice and not self._stop.is_set():
                print(f"error: process {self.rank} stops: {notice}", file=sys.stderr, flush=True)
                os._exit(1)


def fail_fast(trainer, exception: BaseException, line: str | None = None, status: int | None = None) -> NoReturn:
    """End this process of a multi-process job now, and through the store every other one (module docstring).

    Prints ``line`` (default: the error and its traceback), naming the process; exits with ``status``
    (default ``exit_status(exception)``).
    """
    rank, world = trainer.global_rank, trainer.world_size
    summary = f"{type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}".rstrip(": ")
    where = f"after {trainer.global_step} training steps"
    first, notice = _announce(f"process {rank} failed {where} ({summary})")
    if line is None and not first:  # most likely a consequence (a peer gone mid-collective): one line
        line = f"error: process {rank} stops: {notice}; here: {summary}"
    elif line is None:
        stack = "".join(traceback.format_exception(exception))
        line = f"error: process {rank} of {world} failed {where}:\n{stack}"
        line += "error: stopping every process (no checkpoint is saved after an error in one process)"
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    _kill_started_processes(trainer)
    os._exit(exit_status(exception) if status is None else status)


def _announce(notice: str) -> tuple[bool, str]:
    """Publish ``notice`` in the store if this is the job's first failure; return (first, the first's notice)."""
    store = _store()
    if store is None:
        return True, notice
    try:
        if store.add(FAILURES_KEY, 1) == 1:
            store.set(ABORT_KEY, notice)
            return True, notice
        store.wait([ABORT_KEY], timedelta(seconds=2))
        return False, store.get(ABORT_KEY).decode()
    except Exception:  # the store is gone with process 0: the launchers end the rest
        return True, notice


def _kill_started_processes(trainer) -> None:
    """Kill the processes Lightning's launcher started from this one (none elsewhere)."""
    for process in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(Exception):  # already gone
            process.send_signal(signal.SIGKILL)


def forward_signal(trainer) -> Callable[[int], None]:
    """Pass a signal on to the processes Lightning's launcher started from this one (a no-op elsewhere)."""

    def forward(signum: int) -> None:
        for process in getattr(trainer.strategy.launcher, "procs", None) or []:
            if process.poll() is None:
                process.send_signal(signum)

    return forward

