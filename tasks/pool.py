"""A lazily started, reusable pool of worker processes that runs scoring calls with a timeout.

Graders such as math-verify use ``signal.alarm`` (main thread only) and sympy calls that can run
away; running them here keeps the training process safe: a call that raises or outlives its timeout
comes back as a failure, and a hung pool is killed and restarted. One pool per worker count is
shared by every reward of the process and closed at exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: a worker is replaced after this many calls, which bounds the growth of sympy's caches
MAX_TASKS_PER_CHILD = 2000


@dataclass(frozen=True)
class Outcome:
    """The result of one call: ``value`` when ``ok``, else ``error`` (the exception or "timeout")."""

    ok: bool
    value: Any = None
    error: str = ""


def _start_method() -> str:
    """fork where it is safe, else forkserver (Linux) or spawn (macOS / Windows, where fork is unsafe or absent).

    fork: workers start in milliseconds with the parent's imports (math-verify already loaded) and need no
    ``if __name__ == "__main__"`` guard; the children never touch CUDA or torch threads, as with DataLoader
    workers. But a process that has initialised CUDA runs native threads (the CUDA driver's, NCCL's watchdog and
    proxy threads) that may hold locks at the fork, which the child then inherits held:
    such a process starts its pool from a forkserver, a clean single-threaded process.
    """
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver" if _runs_native_threads() else "fork"


def _runs_native_threads() -> bool:
    """Whether this process has initialised CUDA (whose NCCL communicators and driver run threads)."""
    torch = sys.modules.get("torch")  # not imported: no CUDA
    return torch is not None and bool(torch.cuda.is_initialized())


def _init_worker() -> None:
    # A worker must die on the parent's terminate() (SIGTERM) even if the parent installed a handler
    # (Lightning does), and must leave Ctrl-C to the parent.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerPool:
    """``workers`` processes that run ``fn(*args)`` calls with a per-call timeout.

    Calls are queued in order; the wait for a result starts once every earlier call has finished, so
    each call gets at least ``timeout`` seconds of running time. A call that times out marks the pool
    as hung: it is terminated (killing the stuck worker), restarted, and the calls still pending are
    submitted again. The pool is created on first use and re-created in a forked child process.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.restarts = 0
        self._pool: multiprocessing.pool.Pool | None = None
        self._pid = -1

    def _get(self) -> multiprocessing.pool.Pool:
        if self._pool is None or self._pid != os.getpid():
            context = multiprocessing.get_context(_start_method())
            self._pool = context.Pool(self.workers, _init_worker, maxtasksperchild=MAX_TASKS_PER_CHILD)
            self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        """Kill the workers now (pending calls are dropped); the next ``run`` starts a fresh pool."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.terminate()
            self._pool.join()
        self._pool = None

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple], timeout: float) -> list[Outcome]:
        """``[fn(*args) for args in calls]`` in the workers; never raises for a failing call."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        while pending:
            pool = self._get()
            futures = {i: pool.apply_async(fn, calls[i]) for i in pending}
            hung = self._collect(futures, pending, outcomes, timeout)
            if hung is None:
                break
            outcomes[hung] = Outcome(False, error=f"timeout after {timeout:g} s")
            for i in pending:  # results that arrived before the restart are kept
                if outcomes[i] is None and futures[i].ready():
                    outcomes[i] = _outcome(futures[i], 0)
            self.restarts += 1
            log.warning("scoring call %d timed out after %g s; restarting the worker pool", hung, timeout)
            self.close()
            pending = [i for i in pending if outcomes[i] is None]
        return outcomes  # type: ignore[return-value]

    @staticmethod
    def _collect(futures: dict, pending: list[int], outcomes: list, timeout: float) -> int | None:
        """Fill ``outcomes`` in order; return the index of the first call that timed out, if any."""
        for i in pending:
            try:
                outcomes[i] = _outcome(futures[i], timeout)
            except multiprocessing.TimeoutError:
                return i
        return None


def _outcome(future: multiprocessing.pool.AsyncResult, timeout: float) -> Outcome:
    try:
        return Outcome(True, future.get(timeout))
    except multiprocessing.TimeoutError:
        raise
    except Exception as err:  # the call raised in the worker (or its result did not pickle)
        return Outcome(False, error=f"{type(err).__name__}: {err}")


_POOLS: dict[int, WorkerPool] = {}


def get_pool(workers: int) -> WorkerPool:
    """The process-wide pool with ``workers`` workers (created on first use, closed at exit)."""
    if workers not in _POOLS:
        _POOLS[workers] = WorkerPool(workers)
    return _POOLS[workers]


@atexit.register
def close_pools() -> None:
    """Terminate every pool of this process (registered with ``atexit``)."""
    for pool in _POOLS.values():
        pool.close()
