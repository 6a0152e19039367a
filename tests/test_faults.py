"""Fault injection on configs/tiny.yaml: kill -9 at random instants and in the middle of a checkpoint write,
SIGTERM and Ctrl-C, an error on one of 2 processes, a second and a concurrent run in one folder (bad
configurations and inputs: tests/test_faults_input.py).

A killed or interrupted run resumes with ``--ckpt_path last`` to exactly the rewards of an uninterrupted
run; an error on one process ends every process within seconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from sgrpo.eval.report import read_run_metrics
from sgrpo.export import CheckpointError, open_checkpoint
from sgrpo.fit import main
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.run.checkpoints import PARTIAL, resumable

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
WORKER = Path(__file__).with_name("fault_worker.py")
STEPS = 16  # the uninterrupted reference run


def args(root: Path, model_dir: str, *extra: str) -> list[str]:
    return [
        "--config", TINY, f"--trainer.default_root_dir={root}", f"--model.model={model_dir}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.val_check_interval=1000", "--checkpoint_every=1", "--keep_last=2", *extra,
    ]  # fmt: skip


def rewards(root: Path) -> dict[int, float]:
    return dict(read_run_metrics(root)["train/reward"])


def last_step(root: Path) -> int:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("reference")
    main(args(root, model_dir, f"--trainer.max_steps={STEPS}"))
    return rewards(root)


@pytest.fixture
def other_tmpdir(tmp_path) -> Path:
    """A $TMPDIR on another filesystem than the run folder when the machine has one (/dev/shm)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        folder = Path(tempfile.mkdtemp(dir=shm))
        yield folder
        folder.rmdir()  # empty: no checkpoint byte went through $TMPDIR
    else:
        (tmp_path / "tmpdir").mkdir()
        yield tmp_path / "tmpdir"


def launch(root: Path, model_dir: str, tmpdir: Path, *prefix: str) -> subprocess.Popen:
    """A long fit in a fresh interpreter (``prefix``: the worker script and its arguments, else sgrpo.fit)."""
    command = [sys.executable, *(prefix or ("-m", "sgrpo.fit")), *args(root, model_dir, "--trainer.max_steps=1000")]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir)}
    log = open(root.parent / f"{root.name}.log", "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_sigint
    )


def _default_sigint() -> None:  # a background shell starts its jobs with Ctrl-C ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the fit ended early with {process.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def logged_steps(root: Path, version: int = 0) -> int:
    path = root / "lightning_logs" / f"version_{version}" / "metrics.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


def resume_and_compare(root: Path, model_dir: str, reference: dict[int, float], holes: int = 0) -> None:
    """Resume to ``STEPS``; the rewards of every start of the run, merged, are the reference's.

    A kill between a checkpoint and the metrics of its step (logged just after it) loses those metrics:
    ``holes`` steps may be missing.
    """
    main(args(root, model_dir, f"--trainer.max_steps={STEPS}", "--ckpt_path=last"))
    got = rewards(root)
    assert len(set(range(STEPS)) - set(got)) <= holes
    for step in set(got) & set(range(STEPS)):
        assert got[step] == pytest.approx(reference[step], abs=1e-6), step


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------ kills
@pytest.mark.slow
def test_kill_9_then_ctrl_c_at_random_instants_then_resume_reproduces_the_run(model_dir, reference, other_tmpdir,
                                                                              tmp_path, capsys):  # fmt: skip
    """kill -9 at a random instant, a resume stopped by Ctrl-C at another (it saves its step and exits 130: a
    real SIGTERM's exit 143 is test_sigterm_to_the_first_of_2_sharded_processes_stops_both_at_one_steps_end's),
    then a resume to the end: the rewards of the uninterrupted run."""
    root, rng = tmp_path / "run", random.Random(18)
    process = launch(root, model_dir, other_tmpdir)
    wait_for(lambda: (root / "checkpoints" / "last.ckpt").exists(), process)
    with pytest.raises(SystemExit) as refused:  # a second fit into the folder meanwhile is refused
        main(args(root, model_dir, "--trainer.max_steps=3"))
    assert refused.value.code == 2
    line = error_line(capsys)
    assert str(root) in line and f"pid {process.pid}" in line and "in use" in line
    time.sleep(rng.uniform(0.0, 0.6))
    process.kill()
    assert process.wait() == -signal.SIGKILL
    process = launch(root, model_dir, other_tmpdir, "-m", "sgrpo.fit", "--ckpt_path=last")  # then interrupted
    wait_for(lambda: logged_steps(root, 1) > 0, process)
    time.sleep(rng.uniform(0.0, 0.6))
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130  # not 0: a scheduler must not read it as done
    resumed = read_run_metrics(root)["train/reward"]
    assert last_step(root) == resumed[-1][0] + 1  # saved at its last step
    resume_and_compare(root, model_dir, reference, holes=1)
    assert not list((root / "checkpoints").glob(f".*{PARTIAL}"))  # what the kill left was cleared


@pytest.mark.slow
def test_kill_9_in_the_middle_of_writing_last_ckpt(model_dir, reference, other_tmpdir, tmp_path):
    root, marker = tmp_path / "run", tmp_path / "stalled"
    process = launch(root, model_dir, other_tmpdir, str(WORKER), "stall", "5", str(marker))
    wait_for(marker.exists, process)
    process.kill()
    process.wait()
    assert (root / "checkpoints" / f".step5.ckpt{PARTIAL}").exists()  # half written, never renamed (nor linked)
    assert last_step(root) == 4  # the previous one, whole
    resume_and_compare(root, model_dir, reference)
    assert not (root / "checkpoints" / f".step5.ckpt{PARTIAL}").exists()


@pytest.mark.slow
def test_a_kill_during_the_first_checkpoint_write_says_to_start_again(model_dir, other_tmpdir, tmp_path, capsys):
    """Killed while writing its first checkpoint, a run left metrics and logs but no checkpoint: a fresh run was
    refused ("resume it with --ckpt_path last") and so was the resume ("has none; run without --ckpt_path"), each
    sending the user to the other. Both now say there is nothing to resume and to start again with --overwrite true."""
    root, marker = tmp_path / "run", tmp_path / "stalled"
    process = launch(root, model_dir, other_tmpdir, str(WORKER), "stall", "1", str(marker))
    wait_for(marker.exists, process)
    process.kill()
    process.wait()
    assert (root / "checkpoints" / f".step1.ckpt{PARTIAL}").exists() and (root / "metrics.jsonl").exists()
    start_again = "start it again without --ckpt_path, with --overwrite true (deletes checkpoints, "
    lines = []
    for extra in ([], ["--ckpt_path=last"]):  # a fresh run, then the resume
        with pytest.raises(SystemExit) as refused:
            main(args(root, model_dir, "--trainer.max_steps=2", *extra))
        assert refused.value.code == 2
        lines.append(error_line(capsys))
        assert start_again in lines[-1] and f"in {root}), or start in another folder" in lines[-1], lines[-1]
        assert "resume it with --ckpt_path last" not in lines[-1]
    assert "but no checkpoint of it (it stopped before its first was complete): nothing to resume" in lines[0]
    main(args(root, model_dir, "--trainer.max_steps=2", "--overwrite=true"))  # the advice works
    assert last_step(root) == 2 and sorted(rewards(root)) == [0, 1]


def test_a_broken_last_ckpt_falls_back_to_the_newest_that_loads(model_dir, reference, tmp_path, caplog):
    main(args(tmp_path, model_dir, "--trainer.max_steps=5"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100_000])  # as a kill during today's copy from $TMPDIR left it
    resume_and_compare(tmp_path, model_dir, reference)
    for name in ("last.ckpt", "step5.ckpt"):  # one file under two names (a hard link): both truncated
        path = tmp_path / "checkpoints" / name
        assert f"skipped {path}: it does not load (truncated, or not a checkpoint (100,000 bytes))" in caplog.text
    assert "resuming from " + str(tmp_path / "checkpoints" / "step4.ckpt") in caplog.text


def flip_tensor_bytes(path: Path) -> None:
    """Change 8 bytes in the middle of the largest tensor of a checkpoint file, its zip structure intact."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_length + extra_length + info.file_size // 2)
        data = f.read(8)
        f.seek(-8, os.SEEK_CUR)
        f.write(bytes(b ^ 0x5A for b in data))


def test_a_checkpoint_whose_bytes_changed_is_skipped(model_dir, tmp_path):
    """Bytes flipped inside the weights still load (torch does not notice), so the SHA-256 recorded at the write
    finds them: the file is skipped like a truncated one, and refused by export and validate."""
    main(args(tmp_path, model_dir, "--trainer.max_steps=3"))
    folder = tmp_path / "checkpoints"
    last = folder / "last.ckpt"
    assert resumable(folder) == (last, [])
    flip_tensor_bytes(last)
    torch.load(last, map_location="cpu", mmap=True, weights_only=False)  # silent to torch
    corrupt = "it does not load (corrupt: its SHA-256 is not that of the bytes written)"
    # last.ckpt and step3.ckpt are one file under two names (a hard link): both changed, step 2 is the newest whole
    assert resumable(folder) == (folder / "step2.ckpt", [f"skipped {last}: {corrupt}",
                                                         f"skipped {folder / 'step3.ckpt'}: {corrupt}"])  # fmt: skip
    with pytest.raises(CheckpointError, match="corrupt"):
        open_checkpoint(last)
    hidden = sorted(p.name for p in folder.glob(".*"))  # keep_last 2 pruned step1.ckpt and its checksum
    assert hidden == [".last.ckpt.sha256", ".step2.ckpt.sha256", ".step3.ckpt.sha256"]


def test_saves_do_not_need_a_usable_tmpdir(model_dir, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full)  # as a full (or read-only) $TMPDIR
    main(args(tmp_path, model_dir, "--trainer.max_steps=3"))
    assert last_step(tmp_path) == 3


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
    env = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(separate),
             "NODE_RANK": "0"}  # fmt: skip
    ranks = [world | {"LOCAL_RANK": str(r), "RANK": str(r)} for r in range(separate)] or [{}]
    logs = [tmp_path / f"log{i}" for i in range(len(ranks))]
    processes = [subprocess.Popen(command, cwd=REPO, env=env | extra, stdout=open(log, "w"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for extra, log in zip(ranks, logs, strict=True)]  # fmt: skip
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


@pytest.mark.slow
def test_sigterm_to_the_first_of_2_sharded_processes_stops_both_at_one_steps_end(model_dir, tmp_path):
    """SIGTERM to process 0 (Lightning's launcher passes it on to process 1) in the middle of step 2: both finish
    the step, save it together (a sharded checkpoint: a collective) and exit 143."""
    root = tmp_path / "run"
    layout = ["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml"), "--checkpoint_every=100"]
    command = [sys.executable, str(WORKER), "sigterm", "0", "2", *args(root, model_dir, "--trainer.max_steps=5",
                                                                      *layout)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
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


# ------------------------------------------------------------------------------------------ run folders
def test_a_second_fresh_run_into_a_folder_is_refused_and_last_is_this_runs(model_dir, tmp_path, capsys):
    root = tmp_path / "run"
    main(args(root, model_dir, "--trainer.max_steps=2"))
    second = args(root, model_dir, "--model.optimizer.init_args.lr=0.01")
    with pytest.raises(SystemExit) as refused:
        main(second + ["--trainer.max_steps=2"])
    assert refused.value.code == 2
    line = error_line(capsys)
    assert all(s in line for s in (str(root), "--ckpt_path last", "--trainer.default_root_dir", "--overwrite true"))
    main(second + ["--trainer.max_steps=2", "--overwrite=true"])
    main(second + ["--trainer.max_steps=4", "--ckpt_path=last"])
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 4 and state["optimizer_states"][0]["param_groups"][0]["lr"] == 0.01
    assert [p.name for p in sorted((root / "checkpoints").glob("[!.]*"))] == ["last.ckpt", "step3.ckpt", "step4.ckpt"]
    assert sorted(rewards(root)) == [0, 1, 2, 3]


def test_last_ckpt_is_the_final_step_and_only_the_newest_are_kept(model_dir, tmp_path):
    run = args(tmp_path, model_dir, "--checkpoint_every=2", "--keep_last=2", "--trainer.val_check_interval=7")
    main(run + ["--trainer.max_steps=7"])  # it validates after its last step
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("[!.]*")) == ["last.ckpt", "step4.ckpt", "step6.ckpt"]
    assert last_step(tmp_path) == 7
    main(run + ["--trainer.max_steps=9", "--ckpt_path=last"])  # a finished run continues from its end
    assert sorted(rewards(tmp_path)) == list(range(9))


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
            processes = [subprocess.Popen(command, cwd=REPO, env=env | {"LOCAL_RANK": str(r), "RANK": str(r)},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True) for r in (0, 1)]  # fmt: skip
            try:
                outputs = [process.communicate(timeout=90) for process in processes]
            finally:
                for process in processes:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
            for process, (_, err) in zip(processes, outputs, strict=True):
                lines = [line for line in err.splitlines() if line.startswith("error: ")]
                assert process.returncode == 2 and len(lines) == 1 and reason in lines[0], err[-3000:]
                assert "Traceback" not in err, err[-3000:]
    finally:
        unlock_run(lock)
