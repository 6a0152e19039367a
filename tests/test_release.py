"""The final barrier (``sgrpo.distributed.release_process_group``) over 2 gloo processes: a process that fails at the
end alone says so in the store, and one that says nothing is waited for only so long."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sgrpo import distributed


class Engine:
    def close(self) -> None:
        raise RuntimeError("the engine's shutdown failed on this process")


def _run(rank: int, port: int, case: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    engine = Engine()
    if rank == 1 and case == "close_raises":
        distributed.close_before_release(engine.close)
    started = time.monotonic()
    try:
        if rank == 1 and case == "silent":
            os._exit(0)  # as a process the OOM killer ends: no word in the store
        distributed.released_after(lambda: None) if case == "close_raises" else distributed.release_process_group(
            period=0.05, wait=3.0)  # fmt: skip
        out.put((rank, "released", time.monotonic() - started))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(err).__name__}: {err}", time.monotonic() - started))


@pytest.mark.slow
@pytest.mark.bench  # 2 spawned interpreters a case (18 s): in make test-bench; make test runs the unit tests below
@pytest.mark.parametrize("case", ["close_raises", "silent"])
def test_the_final_barrier_does_not_wait_for_a_process_that_will_not_come(case):
    """Process 1's engine shutdown raises in the release (it posts that it left: process 0 leaves at once), or
    process 1 ends without a word (process 0 waits ``wait`` seconds, 3 here, then leaves): before, the wait in the
    store had no end while process 0, the store's host, lived."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=_run, args=(rank, port, case, out)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        results = {}
        while len(results) < (1 if case == "silent" else 2):
            rank, what, seconds = out.get(timeout=90)
            results[rank] = (what, seconds)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    assert results[0][0] == "released", results
    assert results[0][1] < (20.0 if case == "close_raises" else 3.0 + 20.0), results
    if case == "close_raises":
        assert results[1][0] == "RuntimeError: the engine's shutdown failed on this process", results


@pytest.fixture
def one_of_two(monkeypatch):
    """A one-process gloo group on a TCPStore, taken for one process of 2 (``world_size``); the store it gives."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    yield distributed.default_store()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_release_raising_on_this_process_says_so_in_the_store(one_of_two):
    """An engine's shutdown that raises in the release: this process posts that it left (the other's final barrier
    stops waiting for it) and raises."""
    engine = Engine()
    distributed.close_before_release(engine.close)
    with pytest.raises(RuntimeError, match="the engine's shutdown failed"):
        distributed.released_after(lambda: None)
    assert one_of_two.get(distributed.LEFT_KEY).decode() == "process 0 ended with RuntimeError"


def test_the_final_barrier_leaves_when_the_other_left_or_never_comes(one_of_two, capsys):
    """Waiting in the store for the other process: it leaves once the other posted that it left, else after
    ``wait`` seconds, and skips the group's own barrier and its destruction either way."""
    started = time.monotonic()
    distributed.release_process_group(period=0.01, wait=0.3)  # no one comes, no one says why
    assert 0.3 <= time.monotonic() - started < 5.0 and dist.is_initialized()
    assert "1 of 2 processes did not reach the end (none said why)" in capsys.readouterr().err
    one_of_two.delete_key(distributed.RELEASED_KEY)  # a fresh count, as in a job's one release
    one_of_two.set(distributed.LEFT_KEY, "process 1 ended with RuntimeError")
    started = time.monotonic()
    distributed.release_process_group(period=0.01, wait=60.0)
    assert time.monotonic() - started < 5.0
    assert "did not reach the end (process 1 ended with RuntimeError)" in capsys.readouterr().err
