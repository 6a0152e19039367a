"""What a fault does to a run: one process's error ends every process (signals: ``sgrpo.run.signals``).

**Errors.** An error that one process raises alone (an out-of-memory, a bug, a peer lost) leaves the
others waiting in their next collective: on NCCL for the 30-minute collective timeout, holding every
GPU. So with more than one process, ``fail_fast`` prints the error and its traceback, names the process,
tells the others through the process group's store (each process watches it, on a client of its own:
``AbortWatch``, started by ``FailFast``), kills the processes Lightning's launcher started from this one,
stops the vLLM servers it launched (``stop_launched``), finalizes the loggers (at most ``FINALIZE_DEADLINE`` s)
and ends this process with ``os._exit``: no checkpoint save, teardown or interpreter exit, which are collectives
or may wait on one. Every other process sees the notice within a second and ends likewise (or is ended by its
launcher: torchrun and Lightning's launcher kill the others when one exits non-zero). Errors that every process
raises at the same point (``EVERY_PROCESS``: a refused configuration, a refused resume, rewards failing step after
step, an agreed stop) take the ordinary path, and may save.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sgrpo.checks import ConfigError
from sgrpo.distributed import BEFORE_EXIT, default_store, store_key
from sgrpo.rollout_stop import ROLLOUT_STOP, RolloutStop
from sgrpo.run.checkpoints import evaluation_load_failure
from sgrpo.run.guards import GuardError
from sgrpo.run.resume import ResumeError
from sgrpo.run.signals import Stopped

ABORT_KEY, FAILURES_KEY = store_key("abort"), store_key("failures")  # in the process group's store
STOP_KEY = store_key("stop")  # a signal during a rollout (sgrpo.rollout_stop.RolloutStop)


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


def disk_words(disk: OSError) -> tuple[str, str]:
    """A disk error (``disk_fault``) in words: what happened (its message and file) and the fix."""
    where = f" ({disk.filename})" if disk.filename else ""
    return f"{disk.strerror}{where}", "make it writable" if disk.errno == errno.EROFS else "free space there"


def exit_status(exception: BaseException) -> int:
    """The exit status a scheduler should read for ``exception``: 143 SIGTERM, 130 Ctrl-C, else 1."""
    if isinstance(exception, SIGTERMException):
        return 128 + signal.SIGTERM
    if isinstance(exception, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def command_ended(trainer, interrupt, terminate=None) -> None:
    """At the end of a command: SIGINT's and SIGTERM's handlers put back to ``interrupt`` and ``terminate`` (a stop
    replaces them), the watch ended."""
    main = threading.current_thread() is threading.main_thread()
    for signum, handler in ((signal.SIGINT, interrupt), (signal.SIGTERM, terminate)):
        if handler is not None and main:
            signal.signal(signum, handler)
    for callback in trainer.callbacks:
        if isinstance(callback, FailFast):
            callback.stop()


def _store():
    return default_store()  # None without a process group: the launchers still end the others


class AbortWatch:
    """A thread that ends this process once another one has failed (``fail_fast``), checking every ``period`` s;
    it also passes a stop asked for during a rollout between the processes (``share_stop``)."""

    def __init__(self, rank: int, period: float = 0.5, on_abort: Callable[[], None] | None = None) -> None:
        self.rank, self.period = rank, period
        self.on_abort = on_abort or (lambda: hard_exit([], 1))  # called from the watcher thread; must not return
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch from now on (a no-op without a process group, or when already watching).

        The watcher reads the store through its own connection (``Store.clone()``): c10d's TCPStore client holds
        one lock for a whole blocking ``get``/``wait``, so a shared client stayed locked while the main thread
        waited on the store for a peer that had died (building vLLM's or NCCL's groups, a rendezvous), and the
        notice was never read."""
        store = _store()
        if store is None or self._thread is not None:
            return
        with contextlib.suppress(Exception):  # a store that cannot be cloned: the shared client, as before
            store = store.clone()
        self._stop = threading.Event()  # one per watcher thread: a stopped watch may start again
        self._thread = threading.Thread(target=self._watch, args=(store, self._stop), name="sgrpo-abort-watch",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread = None

    @property
    def watching(self) -> bool:
        return self._thread is not None

    def _watch(self, store, stop: threading.Event) -> None:
        lost = 0
        while not stop.wait(self.period):
            try:
                share_stop(store, ROLLOUT_STOP)
                failed = store.check([ABORT_KEY])
                notice = store.get(ABORT_KEY).decode() if failed else ""
                lost = 0
            except Exception:  # the store lives in process 0: gone, unless the run is ending
                lost += 1
                if lost < 3 or stop.is_set() or not torch.distributed.is_initialized():
                    continue
                notice = "process 0 is gone (the process group's store does not answer)"
            if notice and not stop.is_set() and not FAILING.is_set():  # FAILING: fail_fast reports and ends it
                print(f"error: process {self.rank} stops: {notice}", file=sys.stderr, flush=True)
                self.on_abort()


def share_stop(store, stop: RolloutStop) -> None:
    """Post this process's rollout stop in the store (``STOP_KEY``: the signal's number), or read another's."""
    if stop.requested and not stop.posted:
        store.set(STOP_KEY, str(stop.signum))
        stop.posted = True
    elif stop.open and not stop.signum and store.check([STOP_KEY]):
        stop.noticed(int(store.get(STOP_KEY).decode()))


#: set once this process is in ``fail_fast``: its own watch then leaves the report and the exit to it (the watch
#: could read this process's own notice between ``announce`` and the report, and end the process first)
FAILING = threading.Event()


def fail_fast(trainer, exception: BaseException, line: str | None = None, status: int | None = None) -> NoReturn:
    """End this process of a multi-process job now, and through the store every other one (module docstring).

    Prints ``line`` (default: the error and its traceback), naming the process; exits with ``status``
    (default ``exit_status(exception)``).
    """
    FAILING.set()
    rank, world = trainer.global_rank, trainer.world_size
    summary = f"{type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}".rstrip(": ")
    where = f"after {trainer.global_step} training steps"
    first, notice = announce(f"process {rank} failed {where} ({summary})")
    if line is None and not first:  # most likely a consequence (a peer gone mid-collective): one line
        line = f"error: process {rank} stops: {notice}; here: {summary}"
    elif line is None:
        stack = "".join(traceback.format_exception(exception))
        line = f"error: process {rank} of {world} failed {where}:\n{stack}"
        line += "error: stopping every process (no checkpoint is saved after an error in one process)"
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    _kill_started_processes(trainer)
    linger = LINGER if rank == 0 else 0.0  # process 0 holds the store: the others' watches read the notice first
    hard_exit(trainer.loggers, exit_status(exception) if status is None else status, linger=linger)


#: seconds the loggers get to finish before a process ends at once (SLURM kills 30 s after its SIGTERM)
FINALIZE_DEADLINE = 10.0
#: seconds process 0 (the store's host) lives on after a failure, for the other processes' watches to read it
LINGER = 1.5
#: seconds launched servers get after SIGTERM before SIGKILL, when a process ends at once (``stop_launched``)
EXIT_GRACE = 2.0


def hard_exit(loggers: list, status: int, deadline: float = FINALIZE_DEADLINE, linger: float = 0.0) -> NoReturn:
    """``os._exit(status)`` once the loggers are finalized (``finalize_loggers``) or ``deadline`` s have passed.

    ``os._exit`` runs no teardown and no interpreter exit, which may wait on a collective; it also skipped the
    loggers': a W&B run stayed "running" and TensorBoard lost the events still in its queue. They finalize in a
    thread of their own, so that one stuck (a network, a lock the main thread holds) cannot keep the process.
    Meanwhile the servers this process launched stop (``stop_launched``), as ``os._exit`` skips their atexit hook."""
    start = time.monotonic()
    stop_child_observer()
    worker = threading.Thread(target=finalize_loggers, args=(loggers, status), name="sgrpo-finalize", daemon=True)
    worker.start()
    stop_launched(EXIT_GRACE)
    worker.join(max(0.0, start + deadline - time.monotonic()))
    time.sleep(max(0.0, start + linger - time.monotonic()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stop_child_observer() -> None:
    """Stop Lightning's launcher from killing this process as it ends (``hard_exit``).

    ``python -m sgrpo.fit`` with ``devices`` > 1 starts the other processes from process 0, where a thread of
    Lightning's (``_ChildProcessObserver``) polls them every 5 s and, once one has ended with an error, SIGKILLs every
    process, process 0 included. Process 0 ending on its own path (its loggers finalizing, the linger for the
    others to read its notice) was cut there: exit 137 where 1 was due, a W&B run left "crashed" (found by a
    review). Emptied of processes, the observer ends at its next poll without a signal; ``fail_fast`` kills the
    processes it started itself."""
    for thread in threading.enumerate():
        if type(thread).__name__ == "_ChildProcessObserver" and hasattr(thread, "_child_processes"):
            thread._child_processes = []


def stop_launched(grace: float) -> None:
    """Call each ``stop(grace)`` registered by ``sgrpo.distributed.stop_before_exit`` (vLLM servers sgrpo launched:
    SIGTERM, SIGKILL after ``grace`` s). They run in sessions of their own: left alone, they kept their GPUs and
    answered the next run's ``/health`` in place of its own servers. One that fails is skipped."""
    for ref in list(BEFORE_EXIT):
        stop = ref()
        if stop is not None:
            with contextlib.suppress(Exception):
                stop(grace)


def finalize_loggers(loggers: list, status: int) -> None:
    """Each logger's ``finalize("failed")``, and W&B's run finished with exit code ``status`` (Lightning's W&B
    logger leaves that to wandb's exit hook, which ``os._exit`` skips). A logger that fails is skipped."""
    for logger in loggers:
        with contextlib.suppress(Exception):
            logger.finalize("failed")
        run = getattr(logger, "_experiment", None) if type(logger).__name__ == "WandbLogger" else None
        if run is not None and hasattr(run, "finish"):
            with contextlib.suppress(Exception):
                run.finish(exit_code=status)


class FailFast(Callback):
    """Every process of a multi-process job watches the store for another one's failure (``AbortWatch``) from the
    first trainer call's setup to the end of the command (``stop``), through ``validate_before`` and into the fit,
    and in ``validate`` and ``test``; an error one process raises alone ends every process (``fail_fast``).

    In a fit, ``RunCheckpoint`` decides about errors (it tells one that broke a checkpoint's load): ``errors``
    False. An error every process raises (``EVERY_PROCESS``) ends the watch, as every process leaves on the
    ordinary path and process 0, whose store the others watch, may end first.
    """

    def __init__(self, errors: bool = True) -> None:
        self.errors = errors
        self.watch: AbortWatch | None = None
        self._loggers: list = []
        self.failed_load: BaseException | None = None  # an error while the checkpoint to evaluate loaded

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._loggers = list(trainer.loggers)
        if trainer.world_size > 1 and self.watch is None:
            linger = LINGER if trainer.global_rank == 0 else 0.0
            self.watch = AbortWatch(trainer.global_rank, on_abort=lambda: hard_exit(self._loggers, 1, linger=linger))
        if self.watch is not None:
            self.watch.start()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        loading = self.errors and loading_checkpoint(trainer, exception)
        if loading:  # validate or test: the checkpoint does not fit model.model; one line, exit 2
            self.failed_load = exception
        if trainer.world_size > 1 and isinstance(exception, EVERY_PROCESS):
            self.stop()
        elif trainer.world_size > 1 and self.errors:
            line = f"error: {evaluation_load_failure(trainer.ckpt_path, exception)}" if loading else None
            fail_fast(trainer, exception, line, status=2 if loading else None)

    def stop(self) -> None:
        """End the watch (at the end of the command, before the processes leave the process group)."""
        if self.watch is not None:
            self.watch.stop()


#: Lightning's functions that read a checkpoint into the run (its ``_CheckpointConnector``'s and the strategy's)
LOADING = frozenset({
    "resume_start", "_restore_modules_and_callbacks", "restore", "restore_model", "restore_datamodule",
    "restore_training_state", "restore_callbacks", "restore_loops", "restore_optimizers_and_schedulers",
    "restore_optimizers", "restore_lr_schedulers", "restore_precision_plugin_state", "load_checkpoint",
    "load_model_state_dict", "load_optimizer_state_dict",
})  # fmt: skip


def loading_checkpoint(trainer, exception: BaseException) -> bool:
    """Whether ``exception`` arose while the trainer read a checkpoint into the run (raised under one of ``LOADING``
    while Lightning's connector holds one) or was sgrpo's refusal of one (``ResumeError``). Not an error between
    those steps (the model moved to its device, an out-of-memory there), which the connector spans too."""
    if isinstance(exception, ResumeError):
        return True
    if not trainer._checkpoint_connector._loaded_checkpoint:
        return False
    return any(frame.name in LOADING for frame in traceback.extract_tb(exception.__traceback__))


def announce(notice: str) -> tuple[bool, str]:
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
    except Exception:  # the store is gone: process 0, which holds it, has ended (after another's failure, likely)
        return False, "process 0 has ended (the process group's store does not answer)"


def _kill_started_processes(trainer) -> None:
    """Kill the processes Lightning's launcher started from this one (none elsewhere)."""
    for process in getattr(trainer.strategy.launcher, "procs", None) or []:
        with contextlib.suppress(Exception):  # already gone
            process.send_signal(signal.SIGKILL)
