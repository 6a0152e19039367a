"""The abort watch and a failing process's exit, in one process (tests/test_faults.py starts real jobs).

- The watch reads the store through its own client: while the main thread waits on the process group's store
  for a key a dead peer never posts, the notice is still read (c10d's TCPStore client holds one lock for a whole
  blocking ``get``; a watch sharing it read nothing until that ``get`` ended).
- ``fail_fast`` ends the process only after the loggers finalize (or a deadline): TensorBoard keeps the events
  still in its queue, a W&B run is finished (it stayed "running").
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from sgrpo.run import faults
from sgrpo.run.faults import ABORT_KEY, AbortWatch, fail_fast


@pytest.fixture(autouse=True)
def not_failing(monkeypatch):
    """``fail_fast`` marks the process as failing for good (it ends it): each test gets a fresh mark."""
    monkeypatch.setattr(faults, "FAILING", threading.Event())


@pytest.fixture
def process_group():
    """A one-process gloo group on a TCPStore (as torchrun and srun give), destroyed afterwards."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()


def test_the_watch_reads_the_notice_while_the_main_thread_waits_on_the_store(process_group):
    shared, poster = process_group, process_group.clone()
    waiting = threading.Thread(target=lambda: shared.get("sgrpo/never-posted"), daemon=True)
    waiting.start()  # as the main thread building NCCL's or vLLM's groups for a peer that died
    time.sleep(0.3)
    aborted = threading.Event()
    watch = AbortWatch(rank=1, period=0.05, on_abort=aborted.set)
    watch.start()
    try:
        poster.set(ABORT_KEY, "process 2 failed after 0 training steps (RuntimeError: out of memory)")
        seen = aborted.wait(5.0)  # a shared client answers only when the get ends (60 s)
    finally:
        watch.stop()
        poster.set("sgrpo/never-posted", "")  # the waiting get returns
        waiting.join(10)
    assert seen, "the watch did not read the notice while another thread waited on the store"


def test_the_watch_leaves_a_failing_process_to_report_its_own_error(process_group):
    """A process in ``fail_fast`` posts its notice, then prints its traceback: its own watch, reading that notice
    in between, ended it first with a peer's one-line "stops" report and no traceback (seen once in make
    test-bench, a producer killed on process 1 of 2). The watch leaves a failing process alone."""
    aborted = threading.Event()
    watch = AbortWatch(rank=1, period=0.05, on_abort=aborted.set)
    faults.FAILING.set()  # as fail_fast does before it announces
    watch.start()
    try:
        process_group.set(ABORT_KEY, "process 1 failed after 2 training steps (ProducerError: killed)")
        seen = aborted.wait(0.5)  # ten periods
    finally:
        watch.stop()
    assert not seen, "the watch ended a process that was reporting its own failure"
    faults.FAILING.clear()
    watch.start()  # a process not failing itself still stops on the notice
    try:
        assert aborted.wait(5.0)
    finally:
        watch.stop()


class Failing(SimpleNamespace):
    """The parts of a trainer ``fail_fast`` reads."""


def test_fail_fast_finalizes_the_loggers_before_the_process_ends(tmp_path, monkeypatch, capsys):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardLogger(tmp_path, name="tb")
    board.log_metrics({"train/reward": 0.25}, step=3)  # queued: TensorBoard flushes every 120 s or 10 events
    exits: list[int] = []

    def ended(status: int):
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", ended)
    trainer = Failing(global_rank=1, world_size=2, global_step=3, loggers=[board],
                      strategy=SimpleNamespace(launcher=None))  # fmt: skip
    with pytest.raises(SystemExit):
        fail_fast(trainer, RuntimeError("CUDA out of memory"))
    assert exits == [1]
    assert "error: process 1 of 2 failed after 3 training steps" in capsys.readouterr().err
    events = EventAccumulator(str(Path(board.log_dir)))
    events.Reload()
    assert [e.value for e in events.Scalars("train/reward")] == [0.25]  # in the file, not lost with the queue


def test_a_logger_that_hangs_delays_the_exit_by_the_deadline_only(monkeypatch):
    class Stuck:
        def finalize(self, status: str) -> None:
            time.sleep(30)

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    start = time.monotonic()
    faults.hard_exit([Stuck()], 3, deadline=0.2)
    assert exits == [3] and time.monotonic() - start < 2


@pytest.mark.slow  # wandb starts its service process (about 25 s on a busy 2-core machine)
def test_a_wandb_run_is_finished_with_the_exit_code(tmp_path, monkeypatch):
    """Lightning's W&B logger finalizes nothing on failure (wandb's exit hook finished the run, which ``os._exit``
    skips: the run stayed "running"); it is finished, with the process's exit code."""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="sgrpo-test")
    logger.log_metrics({"train/reward": 0.5}, step=1)
    run = logger.experiment
    monkeypatch.setattr(os, "_exit", lambda status: None)
    faults.hard_exit([logger], 1)
    assert wandb.run is None and run._is_finished  # finished: no longer the active run


def test_lightning_s_launcher_does_not_kill_process_0_while_it_ends(tmp_path):
    """Process 0 of ``python -m sgrpo.fit --trainer.devices=2`` runs Lightning's observer of the processes it started:
    one ended with an error, and the observer SIGKILLed process 0 within 5 s, in the middle of its ``hard_exit``
    (the loggers finalizing, the linger): exit 137, a W&B run left "crashed" (found by a review). The observer,
    polling every 0.1 s here, watches a child that fails at once; process 0 ends by ``hard_exit`` with status 1 after
    a 1 s linger."""
    import subprocess
    import sys

    script = tmp_path / "process0.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver\n"
        "from sgrpo.run import faults\n"
        "child = subprocess.Popen([sys.executable, '-c', 'raise SystemExit(1)'])\n"
        "observer = _ChildProcessObserver(os.getpid(), [child], sleep_period=0.1)\n"
        "observer.start()\n"
        "child.wait()\n"
        "faults.hard_exit([], 1, linger=1.0)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
