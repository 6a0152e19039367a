"""Fault injection over several processes, on configs/tiny.yaml (split from tests/test_faults.py, which keeps the
one-process kills and run folders): an error on one of 2 or 3 processes ends every process within seconds, SIGTERM to
one of 2 sharded processes stops both at one step's end, and a refused folder ends every process the launcher started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.preloaded import Preloaded, popen, run
from tests.test_faults import REPO, TINY, WORKER, args, wait_for
from tests.test_faults import model_dir as model_dir  # the module's tiny model (a fixture)

FAILURES = {  # how the processes start, which one fails, what the others do meanwhile, the command's arguments
    "fsdp2-process-1-fails": ("lightning", "raise", "1", ["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml")]),
    "ddp-process-0-fails": ("lightning", "raise", "0", ["--trainer.devices=2", "--trainer.strategy=ddp"]),
    "separate-processes-the-other-waits-on-the-store": ("separate", "raise_hang", "1", ["--trainer.devices=2",
                                                                                        "--trainer.strategy=ddp"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAILURES))
def test_an_error_on_one_process_ends_every_process_within_seconds(case, model_dir, tmp_path):
    """One of 2 processes raises inside the gradient accumulation of step 2 (as an out-of-memory would): every
    process ends within 60 s, non-zero, the error's traceback shown, nothing saved after it.

    Lightning's launcher starts process 1 from process 0: process 0 failing must end it. Processes started
    separately (as srun starts them) with the other one waiting on the process group's store for a key the failed
    one never posts (no collective or launcher tells it) are ended by the notice in the store alone: the watch
    reads it through its own client, as the waiting one holds the shared client's lock.
    """
    launch_kind, mode, rank, layout = FAILURES[case]
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), mode, rank, "2", *args(root, model_dir, "--trainer.max_steps=5", *layout)]
    text, _ = run_failing(command, root, rank, 2 if launch_kind == "separate" else 0, tmp_path)
    assert f"error: process {rank} of 2 failed after 1 training steps" in text, text[-3000:]
    if launch_kind == "separate":
        assert "error: process 0 stops: process 1 failed after 1 training steps" in text
    last = root / "checkpoints" / "last.ckpt"
    state = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=False, mmap=not last.is_dir())
    assert state["global_step"] == 1  # the step before the error: nothing was saved after it


@pytest.mark.slow
def test_an_error_on_one_of_3_processes_in_validate_ends_them_all(model_dir, tmp_path):
    """``sgrpo.fit validate`` on 3 processes started separately (as srun starts them): process 2 raises in its
    first validation batch while processes 0 and 1 wait on the store there. All 3 end within 60 s, non-zero,
    process 2's traceback shown (a validate had no watch: they waited for the process group's timeout)."""
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), "raise_validate", "2", "0", "validate", "--config", TINY,
               f"--trainer.default_root_dir={root}", f"--model.model={model_dir}", "--trainer.devices=3",
               "--trainer.strategy=ddp", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=1"]
    text, _ = run_failing(command, root, "2", 3, tmp_path)
    assert "error: process 2 of 3 failed after 0 training steps" in text
    assert all(f"error: process {r} stops: " in text for r in (0, 1)), text[-3000:]  # one line each, no traceback
    assert "error: process 0 stops: process 2 failed" in text and " of 3 failed" not in text.replace("2 of 3", "")


@pytest.mark.slow
def test_sigterm_to_one_of_2_processes_in_validate_ends_both(model_dir, tmp_path):
    """``sgrpo.fit validate`` on 2 processes started separately (as srun starts them): process 1 gets SIGTERM in its
    first validation batch while process 0 validates on. Lightning's handler broadcast from inside the signal
    handler, a collective process 0 never joined: both hung until the process group's timeout. Now process 1
    stops at its batch's end (143) and process 0 is ended through the store, both within 60 s."""
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), "sigterm_validate", "1", "0", "validate", "--config", TINY,
               f"--trainer.default_root_dir={root}", f"--model.model={model_dir}", "--trainer.devices=2",
               "--trainer.strategy=ddp", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=3",
               "--model.val_prompts_per_batch=2"]  # 3 batches each: Lightning stops at a batch's end but the last
    text, codes = run_failing(command, root, "1", 2, tmp_path, injected=("SIGTERMException",))
    assert codes[1] == 143 and "error: process 0 stops: process 1 failed" in text, (codes, text[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "rank", "status"), [
    pytest.param("report_fails", "0", 1, marks=pytest.mark.bench),  # 17 s: make test-bench (make test's margin)
    ("sigterm_export", "1", 143),
])  # fmt: skip
def test_a_process_that_fails_after_the_fit_alone_leaves_the_others_a_clean_exit(mode, rank, status, model_dir,
                                                                                   tmp_path):  # fmt: skip
    """2 DDP processes started separately: process 0's report raises, or process 1 gets SIGTERM in its part of the
    export, once the others are past the fit. They waited in the final barrier for the failed one: on NCCL until the
    process group's timeout (on gloo here, the peer's closed socket ended them with a traceback). It posts its
    leaving in the store; the others' final barrier stops waiting and they exit 0."""
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), mode, rank, "0",
               *args(root, model_dir, "--trainer.max_steps=1", "--trainer.devices=2", "--trainer.strategy=ddp",
                     *(["--report=true"] if mode == "report_fails" else []))]  # fmt: skip
    processes, logs = start(command, 2, tmp_path)
    codes, text = finish(processes, logs, timeout=240)
    other = 1 - int(rank)
    assert codes[int(rank)] == status and codes[other] == 0, (codes, text[-3000:])
    assert "Traceback" not in logs[other].read_text(), logs[other].read_text()[-3000:]
    assert (root / f"raised.{rank}").exists()


@pytest.mark.bench  # 23 s: with the kill trials, in `make test-bench` (make test keeps the 1-process case, test_async)
def test_a_rollout_producer_that_dies_on_one_of_2_processes_ends_every_process(model_dir, tmp_path):
    """Async rollouts (docs/async.md) on 2 processes started separately: process 1's producer is killed before it
    samples step 2; process 1's trainer raises naming it, and every process ends within 60 s, none left behind."""
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), "producer_dies", "1", "2",
               *args(root, model_dir, "--trainer.max_steps=5", "--trainer.devices=2", "--trainer.strategy=ddp",
                     "--model.async_rollout=true", "--model.max_staleness=0")]  # fmt: skip
    text, _ = run_failing(command, root, "1", 2, tmp_path, injected=("ProducerError", "the rollout producer (process"),
                          env={"SGRPO_TEST_ROOT": str(root)})  # fmt: skip
    assert "ended with exit code -9 before it sent the groups of step 2" in text, text[-3000:]
    assert "error: process 0 stops: process 1 failed" in text


def run_failing(command: list[str], root: Path, rank: str, separate: int, tmp_path: Path,
                injected: tuple[str, str] = ("RuntimeError", "injected fault: out of memory"),
                env: dict | None = None) -> tuple[str, list[int]]:  # fmt: skip
    """Start ``command`` (``separate`` processes with their ranks in the environment, as srun starts them, or one
    that Lightning's launcher multiplies when 0); once process ``rank`` has raised, every process must end within
    60 s, non-zero, leaving none behind, with the injected error's traceback in the output. Returns the output
    of all and the exit codes."""
    processes, logs = start(command, separate, tmp_path, env)
    try:
        wait_for((root / f"raised.{rank}").exists, processes[0], timeout=240)
        raised = time.monotonic()
        codes = [process.wait(timeout=60) for process in processes]
        ended = time.monotonic() - raised
        # an async run's producer ends itself, then its fork server, whose interpreter shutdown (torch and
        # transformers imported) took 9 s at load average 20 (docs/async.md)
        left = time.monotonic() + 30.0
        while time.monotonic() < left and any(live_processes(p.pid) for p in processes):
            time.sleep(0.1)
        leftovers = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:120]) for p in processes
                     for pid in live_processes(p.pid)]  # fmt: skip
        assert not leftovers, leftovers  # none left (zombies aside)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    text = "".join(log.read_text() for log in logs)
    assert all(code != 0 for code in codes), text[-3000:]
    assert f"error: process {rank} of " in text and "Traceback" in text, text[-3000:]
    assert all(part in text for part in injected), text[-3000:]
    print(f"every process ended {ended:.1f} s after the error, exit {codes}")
    return text, codes


def start(command: list[str], separate: int, tmp_path: Path, env: dict | None = None,
          name: str = "log") -> tuple[list[Preloaded | subprocess.Popen], list[Path]]:  # fmt: skip
    """``command`` started as ``separate`` processes with their ranks in the environment (as srun starts them), or
    once (Lightning's launcher multiplies it) when 0; each writes its output to ``tmp_path/<name><rank>``. The first
    is forked from the worker's preloaded interpreter, the others are new interpreters (tests/preloaded.py)."""
    env = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(separate),
             "NODE_RANK": "0"}  # fmt: skip
    ranks = [world | {"LOCAL_RANK": str(r), "RANK": str(r)} for r in range(separate)] or [{}]
    logs = [tmp_path / f"{name}{i}" for i in range(len(ranks))]
    processes = [popen(command, cwd=REPO, env=env | extra, stdout=log, start_new_session=True, fresh=i > 0)
                 for i, (extra, log) in enumerate(zip(ranks, logs, strict=True))]  # fmt: skip
    return processes, logs


def finish(processes: list[Preloaded | subprocess.Popen], logs: list[Path],
           timeout: float = 240) -> tuple[list[int], str]:  # fmt: skip
    """The exit codes of ``processes`` and their output; none left running."""
    try:
        codes = [process.wait(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return codes, "".join(log.read_text() for log in logs)


SIGTERM_IN_ROLLOUT = {  # the layout; which processes get SIGTERM, in that order, 0.3 s apart
    # DDP: no collective in the rollout; process 0 gets no signal and learns of it through the store
    "ddp-process-1-only": (["--trainer.devices=2", "--trainer.strategy=ddp"], [1]),
    # FSDP2 decoding on the sharded model: every forward is a collective (lockstep), so they leave together; the
    # second SIGTERM reaches process 0 while it saves (ignored there) or exits
    "fsdp2-lockstep-both": (["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml"),
                             "--model.rollout.init_args.weights_snapshot=false"], [1, 0]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.bench  # three 2-process launches a case: with the kill trials (make test's margin, docs/development.md;
# make test checks the parts in one process: tests/test_rollout_stop.py)
@pytest.mark.parametrize("case", list(SIGTERM_IN_ROLLOUT))
def test_sigterm_during_the_rollout_stops_every_process_at_once_and_resumes_exactly(case, model_dir, tmp_path):
    """2 processes started separately (as srun starts them) are in step 2's rollout (slowed: 0.3 s a token, the
    first until the signals are sent) when SIGTERM reaches one or both: every process leaves the rollout, saves
    step 1's end and exits 143 within seconds (they used to run step 2 to its end, which a DeepMath step makes
    longer than SLURM's 30 s); the resume logs what the uninterrupted run logged, value for value."""
    from tests.test_interrupts import rows

    layout, signalled = SIGTERM_IN_ROLLOUT[case]
    fit = [sys.executable, "-m", "sgrpo.fit"]
    reference, root = tmp_path / "reference", tmp_path / "run"
    common = ["--trainer.max_steps=3", *layout]
    codes, text = finish(*start([*fit, *args(reference, model_dir, *common)], 2, tmp_path, name="reference"))
    assert codes == [0, 0], text[-3000:]
    processes, logs = start([sys.executable, str(WORKER), "slow_rollout", "0", "2", *args(root, model_dir, *common)],
                            2, tmp_path, name="run")  # fmt: skip
    wait_for(lambda: all((root / f"rollout.{r}").exists() for r in (0, 1)), processes[0], timeout=240)
    for rank in signalled:
        os.kill(processes[rank].pid, signal.SIGTERM)
        time.sleep(0.3)
    sent = time.monotonic()
    (root / "signalled").touch()  # the slowed rollouts go on (0.3 s a token)
    codes, text = finish(processes, logs, timeout=60)
    ended = time.monotonic() - sent
    # 143; or ended by a SIGTERM that came after its save (Lightning's teardown puts the default handler back)
    assert all(c == 143 or (c == -signal.SIGTERM and r in signalled) for r, c in enumerate(codes)), text[-3000:]
    assert "every process stops at its rollout's next check" in text and "Traceback" not in text, text[-3000:]
    last = root / "checkpoints" / "last.ckpt"
    state = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=False, mmap=not last.is_dir())
    assert state["global_step"] == 1, text[-3000:]  # step 1's end: step 2 was not run to its end
    print(f"{case}: both exited 143 {ended:.1f} s after the last SIGTERM")
    codes, text = finish(*start([*fit, *args(root, model_dir, *common, "--ckpt_path=last")], 2, tmp_path,
                                name="resume"))  # fmt: skip
    assert codes == [0, 0], text[-3000:]
    expected, got = rows(reference), rows(root)
    assert sorted(got) == sorted(expected)
    for key, points in expected.items():
        assert got[key] == points, key


@pytest.mark.slow
def test_sigterm_to_the_first_of_2_sharded_processes_stops_both_at_one_steps_end(model_dir, tmp_path):
    """SIGTERM to process 0 (Lightning's launcher passes it on to process 1) in the middle of step 2: both finish
    the step, save it together (a sharded checkpoint: a collective) and exit 143."""
    root = tmp_path / "run"
    layout = ["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml"), "--checkpoint_every=100"]
    command = [sys.executable, str(WORKER), "sigterm", "0", "2", *args(root, model_dir, "--trainer.max_steps=5",
                                                                      *layout)]  # fmt: skip
    done = run(command, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=240)  # a preloaded process 0
    assert done.returncode == 143, done.stderr[-3000:]
    assert torch.load(root / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)["global_step"] == 2
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_processes(group: int) -> list[int]:
    """The processes of process group ``group`` still running (a zombie has ended; no reaper may collect it)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state ppid pgrp ...
            if int(fields[2]) == group and fields[0] != "Z":
                alive.append(int(stat.parent.name))
    return alive


@pytest.mark.slow
def test_a_refused_folder_ends_every_process_the_launcher_started_in_seconds(model_dir, tmp_path):
    """2 processes started separately (as srun and torchrun start them) into a folder that holds a run and is in
    use: process 0 refuses ("in use", its first check; "holds a run" takes the same path) and every process exits
    2 with its line within seconds (process 1 used to wait in the rendezvous for the process group's 30-minute
    timeout), no model loaded."""
    from sgrpo.run.folders import lock_run, unlock_run

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "metrics.jsonl").write_text("{}\n")  # an earlier run's output
    lock = lock_run(busy)  # another fit holds it
    try:
        for root, reason in ((busy, "is in use by"),):
            command = [sys.executable, "-m", "sgrpo.fit", *args(root, model_dir, "--trainer.max_steps=2",
                                                                "--trainer.devices=2", "--trainer.strategy=ddp")]
            env = os.environ | {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                "WORLD_SIZE": "2", "NODE_RANK": "0"}  # fmt: skip
            outs, errs = [tmp_path / f"out{r}" for r in (0, 1)], [tmp_path / f"err{r}" for r in (0, 1)]
            processes = [popen(command, cwd=REPO, env=env | {"LOCAL_RANK": str(r), "RANK": str(r)}, stdout=outs[r],
                               stderr=errs[r], start_new_session=True, fresh=r > 0) for r in (0, 1)]  # fmt: skip
            codes, _ = finish(processes, [], timeout=90)
            for code, err in zip(codes, (path.read_text() for path in errs), strict=True):
                lines = [line for line in err.splitlines() if line.startswith("error: ")]
                assert code == 2 and len(lines) == 1 and reason in lines[0], err[-3000:]
                assert "Traceback" not in err, err[-3000:]
    finally:
        unlock_run(lock)
