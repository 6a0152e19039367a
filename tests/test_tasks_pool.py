"""The reward worker pool (``tasks.pool.WorkerPool``): per-call timeouts, restarts, worker deaths blamed on the
call that ran, a clean terminate after a death, and what a forked worker inherits."""

import multiprocessing
import os
import signal
import threading
import time

import torch

from tasks.pool import Outcome, WorkerPool


def test_pool_keeps_results_that_arrived_before_a_restart():
    pool = WorkerPool(2)
    try:
        outcomes = pool.run(time.sleep, [(0.0,), (30.0,), (0.0,), (0.0,)], timeout=0.5)
        assert [o.ok for o in outcomes] == [True, False, True, True]
        assert "timeout" in outcomes[1].error and pool.restarts == 1
    finally:
        pool.close()


def test_calls_hanging_together_cost_one_timeout_not_one_each():
    """4 calls that hang at once in 4 workers fail together at the first timeout, one restart (before: the first
    one failed, the pool restarted, and each other one got a fresh timeout: 4 restarts, 4 timeouts one after
    another); a call queued behind them still gets its full run after the restart."""
    pool = WorkerPool(4)
    try:
        pool.run(time.sleep, [(0.0,)] * 5, timeout=10.0)  # an earlier run: its starts, long past, are not this run's
        start = time.perf_counter()
        outcomes = pool.run(time.sleep, [(30.0,)] * 4 + [(0.0,)], timeout=0.5)
        assert [o.ok for o in outcomes] == [False] * 4 + [True]
        assert all("timeout after 0.5 s" in o.error for o in outcomes[:4])
        assert pool.restarts == 1 and time.perf_counter() - start < 1.9
    finally:
        pool.close()


def _nap_or_die(seconds: float, die: bool, runs: str) -> float:
    """Sleep ``seconds``, then (``die``) note the run in the file ``runs`` and kill this worker (a segfault, the OOM
    killer)."""
    time.sleep(seconds)
    if die:
        with open(runs, "a") as f:
            f.write("run\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return seconds


def test_a_worker_that_dies_fails_the_call_it_ran_not_the_others_running_then(tmp_path):
    """8 calls on 4 workers, the last killing its worker: the pool blamed the first call still waiting, so the
    calls the other workers ran then failed as "worker process died" (a tool failure in another episode) and the
    killing call was submitted again after each restart (it ran 4 times). The call the dead worker announced is
    the one that fails, once."""
    runs = tmp_path / "runs"
    pool = WorkerPool(4)
    try:
        pool.run(time.sleep, [(0.0,)] * 4, timeout=10.0)  # warm: the workers up
        outcomes = pool.run(_nap_or_die, [(0.3, False, str(runs))] * 7 + [(0.1, True, str(runs))], timeout=10.0)
        assert [o.ok for o in outcomes] == [True] * 7 + [False] and outcomes[7].error.startswith("worker process died")
        assert [o.value for o in outcomes[:7]] == [0.3] * 7
        assert runs.read_text().count("run") == 1 and pool.restarts == 1
    finally:
        pool.close()
    # on 2 workers, one dies while the pool waits out a timed-out call's neighbour: its call fails too, once
    runs.unlink()
    pool = WorkerPool(2)
    try:
        outcomes = pool.run(_nap_or_die, [(100.0, False, ""), (0.6, False, ""), (0.6, True, str(runs))], timeout=1.0)
        assert [(o.ok, o.error[:19]) for o in outcomes] == [
            (False, "timeout after 1 s"), (True, ""), (False, "worker process died")]  # fmt: skip
        assert runs.read_text().count("run") == 1 and pool.restarts == 1
    finally:
        pool.close()


def test_an_idle_worker_killed_costs_a_restart_not_a_call_nor_ten_seconds():
    """The OOM killer may pick an idle worker (forked, it shows the trainer's pages): it died holding the task queue's
    read lock, so the restart's terminate() waited for that lock 10 s (and left its thread stuck for good), and the
    call waited for failed as "worker process died" though it never ran. Now: a restart, and every call runs."""
    stuck_before = {t for t in threading.enumerate() if t.name == "sgrpo-pool-terminate"}  # other tests' (xdist)
    pool = WorkerPool(2)
    try:
        pool.run(time.sleep, [(0.05,)] * 2, timeout=10.0)
        time.sleep(0.2)  # both idle, one of them in the task queue's get()
        os.kill(pool._pool._pool[0].pid, signal.SIGKILL)
        time.sleep(0.3)
        start = time.perf_counter()
        outcomes = pool.run(time.sleep, [(0.1,)] * 4, timeout=3.0)
        assert all(o.ok for o in outcomes) and pool.restarts == 1 and time.perf_counter() - start < 5
        assert not [t for t in threading.enumerate() if t.name == "sgrpo-pool-terminate" and t not in stuck_before]
    finally:
        pool.close()


def _sized_or_exit(i: int, payload: str, exit_at: int) -> int:
    """``len(payload)``, or (call ``exit_at``) end this worker 0.2 s later with exit code 3 (a segfault, the OOM
    killer)."""
    if i == exit_at:
        time.sleep(0.2)
        os._exit(3)
    return len(payload)


def test_a_death_with_calls_still_queued_ends_the_pool_cleanly(capfd, caplog):
    """A worker that died gave terminate() a fresh lock to drain the task queue, but the live workers (and the one
    forked to replace the dead) kept reading the queue's pipe under the old lock: each read part of a message, and
    terminate's thread died of an UnpicklingError (the live workers were left blocked, with the pool's threads),
    or waited 10 s for a garbage length, or a worker printed the traceback. Now the restart ends every worker."""
    children = set(multiprocessing.active_children())  # other tests' (xdist)
    threads = set(threading.enumerate())
    errors = []
    hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    payload = "x" * 1_000_000  # messages bigger than the pipe: read in parts, so readers racing split them
    pool = WorkerPool(2)
    try:
        for restarts in range(1, 5):  # each race was lost about 2 times in 3
            start = time.perf_counter()
            outcomes = pool.run(_sized_or_exit, [(i, payload, 0) for i in range(80)], timeout=10.0)  # 0 dies at 0.2 s
            assert [i for i, o in enumerate(outcomes) if not o.ok] == [0] and pool.restarts == restarts
            assert time.perf_counter() - start < 30  # about 1 s (4 s seen under load); a stall also logs, below
    finally:
        pool.close()
        threading.excepthook = hook
    assert not errors and "did not terminate" not in caplog.text
    assert not [p for p in multiprocessing.active_children() if p not in children]
    assert not [t for t in threading.enumerate() if t not in threads]
    assert "Traceback" not in capfd.readouterr().err


def test_many_calls_in_one_run_need_no_restart():
    """Each call announces its start on a queue the pool reads all along: read only after a timeout, its pipe filled
    after about 1,800 calls, a worker then blocked before its call, and that call timed out (a restart, a reward
    of 0) with nothing hung."""
    pool = WorkerPool(2)
    try:
        outcomes = pool.run(abs, [(-i,) for i in range(4000)], timeout=2.0)
        assert all(o.ok for o in outcomes) and [o.value for o in outcomes[-2:]] == [3998, 3999]
        assert pool.restarts == 0
    finally:
        pool.close()


def _torch_reward(n: int) -> float:
    a = torch.ones(n, n)
    return float((a @ a)[0, 0]) / n


def test_a_worker_forked_after_the_trainers_threads_ran_scores_with_torch():
    """A forked worker of a process whose OpenMP threads had run (any CPU fit) hung in its first parallel torch op,
    so a reward using torch timed out on every call; workers run torch on one thread, as DataLoader's do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(256, 256) @ torch.ones(256, 256)  # the parent's OpenMP pool is up
        pool = WorkerPool(1)
        try:
            assert pool.run(_torch_reward, [(256,)], timeout=10.0)[0] == Outcome(True, 1.0)
        finally:
            pool.close()
    finally:
        torch.set_num_threads(threads)


def test_retired_workers_do_not_keep_file_descriptors_open(monkeypatch):
    """A worker retired after MAX_TASKS_PER_CHILD calls was kept in the pool's set of workers seen, its pipe's two
    file descriptors with it, until close: a long run ran out of them ("Too many open files")."""
    import os

    import tasks.pool

    monkeypatch.setattr(tasks.pool, "MAX_TASKS_PER_CHILD", 1)
    pool = WorkerPool(1)
    try:
        pool.run(abs, [(-1,)], timeout=10.0)
        opened = len(os.listdir("/proc/self/fd"))
        for _ in range(15):  # one call at a time: a worker retires after each
            assert pool.run(abs, [(-1,)], timeout=10.0)[0].value == 1
        assert len(os.listdir("/proc/self/fd")) - opened < 6  # before: +2 per retired worker
    finally:
        pool.close()


def test_a_replacement_worker_that_dies_at_once_fails_its_call_at_once(monkeypatch):
    """The pool replaces a worker after ``MAX_TASKS_PER_CHILD`` calls and drops an exited one from its list within
    0.1 s: a replacement that died on its first call could come and go between two looks at that list, and its call
    then failed only at its timeout (2 runs of 3 before). Every worker the pool creates is recorded now."""
    import tasks.pool

    monkeypatch.setattr(tasks.pool, "MAX_TASKS_PER_CHILD", 2)
    pool = WorkerPool(1)
    try:
        for _ in range(3):
            for i in range(2):  # the worker's two calls: it retires, and a fresh one takes the next call
                assert pool.run(abs, [(-i,)], timeout=10.0)[0] == Outcome(True, i)
            started = time.monotonic()
            (died,) = pool.run(os._exit, [(3,)], timeout=10.0)  # at once: no time to be seen
            assert died.error == "worker process died (exit code 3)" and time.monotonic() - started < 5, died
    finally:
        pool.close()
