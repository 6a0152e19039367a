"""A lazily started, reusable pool of worker processes that runs calls (scoring, tools) with a timeout.

Graders such as math-verify use ``signal.alarm`` (main thread only) and sympy calls that can run
away; running them here keeps the training process safe: a call that raises or outlives its timeout
comes back as a failure, and a hung pool is killed and restarted. The timeout is wall time, so it also ends
a call that hangs without spending CPU; a grader's own deadline (``tasks.mathguard._deadline``) counts CPU
time and is set well under it, so that load alone (a worker waiting for a core) reaches neither. A call that
ends its worker (``sys.exit`` and any other exception are caught in the worker; ``os._exit``, a crash or the
OOM killer are not) comes back at once as a failure naming the worker's exit code, and the pool is restarted.
One pool per worker count is shared by every reward of the process and closed at exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.pool
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: a worker is replaced after this many calls, which bounds the growth of sympy's caches
MAX_TASKS_PER_CHILD = 2000
#: seconds between two looks at the workers while waiting for a result (a dead one is noticed this soon)
POLL_S = 0.05


@dataclass(frozen=True)
class Outcome:
    """The result of one call: ``value`` when ``ok``, else ``error`` (the exception or "timeout")."""

    ok: bool
    value: Any = None
    error: str = ""


def _start_method() -> str:
    """fork where it is safe, else forkserver (Linux) or spawn (macOS / Windows, where fork is unsafe or absent).

    fork: workers start in milliseconds with the parent's imports (math-verify already loaded) and need no
    ``if __name__ == "__main__"`` guard; the children never touch CUDA, and run torch on one thread
    (``_init_worker``), as DataLoader workers do. But a process that has initialised CUDA runs native threads
    (the CUDA driver's, NCCL's watchdog and proxy threads) that may hold locks at the fork, which the child then
    inherits held: such a process starts its pool from a forkserver, a clean single-threaded process.
    """
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver" if _runs_native_threads() else "fork"


def _runs_native_threads() -> bool:
    """Whether this process has initialised CUDA (whose NCCL communicators and driver run threads)."""
    torch = sys.modules.get("torch")  # not imported: no CUDA
    return torch is not None and bool(torch.cuda.is_initialized())


#: in a worker: where each call announces its round, index and start time (``time.monotonic``, system-wide)
_STARTED = None


def _init_worker(started=None) -> None:
    """A worker must die on the parent's terminate() (SIGTERM) even if the parent installed a handler (Lightning
    does), and must leave Ctrl-C to the parent. torch runs on one thread here: a worker forked from a trainer whose
    OpenMP threads had run (any CPU fit) hung in its first parallel torch op (GNU OpenMP's pool does not survive a
    fork), so a reward using torch timed out on every call."""
    global _STARTED
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STARTED = started
    torch = sys.modules.get("torch")  # imported by the parent (fork) or by the reward itself later: both covered
    if torch is not None:
        torch.set_num_threads(1)


def _terminate(pool: multiprocessing.pool.Pool, grace: float = 1.0, deadline: float = 10.0,
               died: bool = False) -> None:  # fmt: skip
    """``pool.terminate()``, which cannot hang (``died``: a worker of the pool died; see ``_lock_out``).
    ``Pool.terminate`` signals its workers, then joins them; a worker that the pool's handler thread forks in between
    (replacing a worker that died or retired after ``maxtasksperchild`` tasks) never gets the signal, and the join
    waits for it forever (seen: a reward worker that died, replaced while the pool was terminated). Here the
    terminate runs in a thread; a worker still alive ``grace`` seconds later is killed, and after ``deadline``
    seconds the pool is left to the daemon thread."""

    terminating: list[float] = []  # when pool.terminate() began: a kill during the lock-out could cut a message

    def end() -> None:
        if died:
            _lock_out(pool, grace)
        terminating.append(time.monotonic())
        pool.terminate()

    ender = threading.Thread(target=end, name="sgrpo-pool-terminate", daemon=True)
    ender.start()
    started = time.monotonic()
    while ender.is_alive() and time.monotonic() - started < deadline:
        ender.join(0.1)
        if ender.is_alive() and terminating and time.monotonic() - terminating[0] > grace:
            for worker in list(getattr(pool, "_pool", ())):  # the pool's worker processes (CPython's attribute)
                if worker.is_alive():
                    worker.kill()
    if ender.is_alive():
        log.warning("the reward worker pool did not terminate within %.0f s; left to a background thread", deadline)


def _lock_out(pool: multiprocessing.pool.Pool, grace: float) -> None:
    """Before ``terminate()`` drains the task queue of a pool whose worker died, keep its workers from reading the
    queue, and give the drain a lock of its own. An idle worker killed (the OOM killer) may have died holding the
    queue's read lock, for which the drain waited forever; but with only a fresh lock, the live workers (and the one
    forked to replace the dead) read the queue's pipe together with the drain, each taking part of a message: an
    UnpicklingError ended terminate's thread (the pool's threads and workers were left), or the drain waited for a
    garbage length (10 s). So the pool's handlers stop first (no worker is forked after the swap, no task queued,
    and a worker idle in the queue's read gets a stop message and lets the lock go), then the lock is taken and
    kept: a lock still held ``grace`` seconds later is a dead worker's, which keeps the live workers out too."""
    inqueue = getattr(pool, "_inqueue", None)  # CPython's attributes
    handlers = [getattr(pool, name, None) for name in ("_worker_handler", "_task_handler")]
    if not (hasattr(inqueue, "_rlock") and hasattr(pool, "_ctx") and hasattr(pool, "_change_notifier")):
        return
    if all(isinstance(handler, threading.Thread) for handler in handlers):
        for handler in handlers:
            handler._state = multiprocessing.pool.TERMINATE
        pool._change_notifier.put(None)  # wakes the worker handler, which then stops the task handler
        handlers[0].join(grace)  # at most a fork to finish
    inqueue._rlock.acquire(timeout=grace)
    inqueue._rlock = pool._ctx.Lock()


class _RecordingPool(multiprocessing.pool.Pool):
    """A ``Pool`` that appends each worker process it creates to ``born``, the replacements too: the pool drops an
    exited worker from its list within 0.1 s, so one that died right after it replaced another went unseen, and its
    call failed only at its timeout."""

    def __init__(self, *args: Any, born: list, **kwargs: Any) -> None:
        def process(ctx, *a: Any, **k: Any):
            worker = ctx.Process(*a, **k)
            born.append(worker)
            return worker

        self.Process = process  # the instance's: __init__ and the worker handler create every worker through it
        super().__init__(*args, **kwargs)


class WorkerPool:
    """``workers`` processes that run ``fn(*args)`` calls with a per-call timeout.

    Calls are queued in order; the wait for a result starts once every earlier call has finished, so
    each call gets at least ``timeout`` seconds of running time. A call that times out marks the pool
    as hung: it fails, with every other call running then that is still unfinished once it has run ``timeout``
    seconds (k calls hanging together cost about one timeout per ``workers`` of them, not k), the pool is
    terminated (killing the stuck workers), restarted, and the calls still pending are submitted again. A worker
    that dies (a non-zero exit code) fails the call it was running (as announced on the start queue; the first
    call still waiting where none was announced twice in a run: a worker killed idle costs a restart, not a call),
    and the pool is restarted likewise: the calls the other workers ran then are not blamed, and run again.
    The pool is created on first use and re-created in a forked child process.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.restarts = 0
        self._pool: multiprocessing.pool.Pool | None = None
        self._pid = -1
        self._workers: set = set()  # worker processes seen since the pool started (the pool forgets dead ones)
        self._born: list = []  # worker processes the pool created, not yet seen (``_RecordingPool``)
        self._started = None  # the queue on which the workers announce each call's start
        self._round = 0  # submissions so far
        self._starts: dict[int, float] = {}  # this round's calls' start times, by index (read from the queue)
        self._running: dict[int, int] = {}  # this round's call each worker (by pid) started last, by index
        self._unexplained = 0
        self._lock = threading.Lock()  # one run at a time

    def _get(self) -> multiprocessing.pool.Pool:
        if self._pool is None or self._pid != os.getpid():
            context = multiprocessing.get_context(_start_method())
            self._started, self._born = context.SimpleQueue(), []
            self._pool = _RecordingPool(self.workers, _init_worker, (self._started,), MAX_TASKS_PER_CHILD,
                                        context=context, born=self._born)  # fmt: skip
            self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        """Kill the workers now (pending calls are dropped); the next ``run`` starts a fresh pool."""
        if self._pool is not None and self._pid == os.getpid():
            _terminate(self._pool, died=bool(self._dead_workers()))
        self._pool = None
        self._workers, self._started, self._born = set(), None, []

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout: float) -> list[Outcome]:
        """``[fn(*args) for args in calls]`` in the workers; never raises for a failing call. Callers from several
        threads (an environment's ``concurrent_steps``) take turns: a restart would kill another's calls."""
        with self._lock:
            return self._run(fn, calls, timeout)

    def _run(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout: float) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        self._unexplained = 0  # deaths in this run with no call announced: an idle worker killed, a failed start
        while pending:
            pool = self._get()
            self._see_workers()  # the workers retired since the last run let go (each holds two descriptors)
            self._round, self._starts, self._running = self._round + 1, {}, {}  # older rounds' announcements: ignored
            futures = {i: pool.apply_async(_guarded, ((self._round, i), fn, *calls[i])) for i in pending}
            failed = self._collect(futures, pending, outcomes, timeout)
            if failed is None:
                break
            for i in pending:  # results that arrived before the restart are kept
                if outcomes[i] is None and futures[i].ready():
                    outcomes[i] = _outcome(futures[i], 0)
            for i, error in failed.items():
                outcomes[i] = Outcome(False, error=error)
            self.restarts += 1
            hung, errors = sorted(failed), "; ".join(sorted(set(failed.values())))
            calls_failed = f"call {hung[0]}" if len(hung) == 1 else f"{len(hung)} calls ({', '.join(map(str, hung))})"
            if failed:
                log.warning("worker pool: %s failed: %s; restarting the worker pool", calls_failed, errors)
            else:
                log.warning("worker pool: a worker process died running no call; restarting the worker pool")
            self.close()
            pending = [i for i in pending if outcomes[i] is None]
        return outcomes  # type: ignore[return-value]

    def _collect(self, futures: dict, pending: list[int], outcomes: list, timeout: float) -> dict[int, str] | None:
        """Fill ``outcomes`` in order; return the calls that failed, with why (``None``: none did): the calls that
        workers which died were running, or the first one that timed out with every unfinished call that has run
        ``timeout`` seconds (and the calls of workers that died meanwhile)."""
        for i in pending:
            deadline = time.monotonic() + timeout
            self._read_starts()
            while not futures[i].ready():
                self._read_starts()
                died = self._died(futures, pending, outcomes, i)
                if died is not None:
                    return died
                if time.monotonic() >= deadline:
                    hung = [i, *self._overdue(futures, pending, outcomes, timeout, i)]
                    return (self._died(futures, pending, outcomes) or {}) | dict.fromkeys(
                        hung, f"timeout after {timeout:g} s")  # fmt: skip
                futures[i].wait(POLL_S)
            outcomes[i] = _outcome(futures[i], 0)
        return None

    def _died(self, futures: dict, pending: list[int], outcomes: list, waited: int | None = None):
        """None while no worker has died; else the unfinished calls the dead workers announced, each failed with its
        worker's exit code (the announcements read again: a worker may die right after its own), or, where none
        did, ``waited`` (the call waited for, when given)."""
        dead = self._dead_workers()
        if not dead:
            return None
        self._read_starts()
        blamed = {}
        for worker in dead:
            ran = self._running.get(worker.pid)
            if ran in pending and outcomes[ran] is None and not futures[ran].ready():
                blamed[ran] = f"worker process died (exit code {worker.exitcode})"
        if not blamed and waited is not None:  # none announced: a restart first, then (again) the call waited for
            self._unexplained += 1
            if self._unexplained > 1:
                blamed[waited] = f"worker process died (exit code {dead[0].exitcode})"
        return blamed

    def _overdue(self, futures: dict, pending: list[int], outcomes: list, timeout: float, first: int) -> list[int]:
        """The calls other than ``first`` (which timed out) that hang too: each unfinished call that had started by
        now (as announced on the start queue) is given until it has run ``timeout`` seconds (at most ``timeout``
        more), and those still unfinished then are returned; the ones not started are left to the restart."""
        self._read_starts()
        started = self._starts
        running = [i for i in pending if i != first and outcomes[i] is None and i in started]
        end = max((started[i] + timeout for i in running), default=0.0)
        while time.monotonic() < end and not all(futures[i].ready() for i in running):
            if self._dead_workers():  # the restart kills them anyway: they run again after it
                break
            time.sleep(POLL_S)
        now = time.monotonic()
        return [i for i in running if not futures[i].ready() and now - started[i] >= timeout]

    def _read_starts(self) -> None:
        """Take the start announcements waiting on the queue (this round's into ``_starts``): read all along, as the
        queue's pipe holds about 1,800 of them, and a worker whose announcement did not fit blocked before its call
        (which then timed out)."""
        while self._started is not None and not self._started.empty():
            (round_, index), pid, at = self._started.get()
            if round_ == self._round:  # not a call of an earlier run (the pool serves every run of the process)
                self._starts[index], self._running[pid] = at, index

    def _dead_workers(self) -> list:
        """The worker processes that died (a non-zero exit code; 0 is a worker retired after ``MAX_TASKS_PER_CHILD``,
        which is forgotten: each one kept held its pipe's two file descriptors open until ``close``)."""
        self._see_workers()
        return [worker for worker in self._workers if worker.exitcode not in (None, 0)]

    def _see_workers(self) -> None:
        """Every worker the pool created into ``_workers`` (a replacement that died at once too), less the retired."""
        while self._born:
            self._workers.add(self._born.pop())
        self._workers = {worker for worker in self._workers if worker.exitcode != 0}


def _outcome(future: multiprocessing.pool.AsyncResult, timeout: float) -> Outcome:
    try:
        return Outcome(True, future.get(timeout))
    except multiprocessing.TimeoutError:
        raise
    except Exception as err:  # the call raised in the worker (or its result did not pickle)
        return Outcome(False, error=f"{type(err).__name__}: {err}")


def _guarded(call: tuple[int, int], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker, its start announced first (``call``: the round and the call's index; the worker's
    pid), where
    ``sys.exit`` (which the pool would let end the worker, losing the call) is an error like any other."""
    if _STARTED is not None:
        _STARTED.put((call, os.getpid(), time.monotonic()))
    try:
        return fn(*args)
    except SystemExit as err:
        raise RuntimeError(f"the reward called sys.exit({err.code!r})") from None


_POOLS: dict[int, WorkerPool] = {}


def require_picklable(function: Callable[..., Any], what: str, fix: str) -> None:
    """``ValueError`` naming ``what`` and ``fix`` unless ``function`` pickles: one that does not (a lambda, a function
    defined inside another) would fail every call in a worker, each only counted as a failure."""
    try:
        pickle.dumps(function)
    except Exception as err:  # noqa: BLE001 - pickling raises PicklingError, AttributeError, TypeError...
        raise ValueError(f"{what} {function!r} cannot go to a worker process ({err}): define it at the top level of "
                         f"a module, or {fix}") from None  # fmt: skip


def get_pool(workers: int) -> WorkerPool:
    """The process-wide pool with ``workers`` workers (created on first use, closed at exit)."""
    if workers not in _POOLS:
        _POOLS[workers] = WorkerPool(workers)
    return _POOLS[workers]


def _unlock_pools() -> None:
    """In a forked child, every pool's lock free (a thread of the parent may have held one at the fork)."""
    for pool in _POOLS.values():
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_pools)


@atexit.register
def close_pools() -> None:
    """Terminate every pool of this process (registered with ``atexit``)."""
    for pool in _POOLS.values():
        pool.close()
