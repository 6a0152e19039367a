"""Fault injection on configs/tiny.yaml: kill -9 at random instants and in the middle of a checkpoint write,
SIGTERM and Ctrl-C, a second and a concurrent run in one folder, bad configurations and inputs.

A killed or interrupted run resumes with ``--ckpt_path last`` to exactly the rewards of an uninterrupted
run; everything refused is refused in one line (exit 2) before any model loads.
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

from sgrpo.checkpoints import PARTIAL, resumable
from sgrpo.export import CheckpointError, open_checkpoint
from sgrpo.fit import main
from sgrpo.guards import prompt_limit, within_limit
from sgrpo.preflight import ConfigError, check_strategy
from sgrpo.report import read_run_metrics
from sgrpo.tiny import build_char_tokenizer, ensure_tiny_model
from sgrpo.types import Example
from tasks.base import Reward

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
def test_kill_9_then_sigterm_at_random_instants_then_resume_reproduces_the_run(model_dir, reference, other_tmpdir,
                                                                               tmp_path, capsys):  # fmt: skip
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
    process = launch(root, model_dir, other_tmpdir, "-m", "sgrpo.fit", "--ckpt_path=last")  # then preempted
    wait_for(lambda: logged_steps(root, 1) > 0, process)
    time.sleep(rng.uniform(0.0, 0.6))
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143  # not 0: a scheduler must not read it as done
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
    assert (root / "checkpoints" / f".last.ckpt{PARTIAL}").exists()  # half written, never renamed
    assert last_step(root) == 4  # the previous one, whole
    resume_and_compare(root, model_dir, reference)
    assert not (root / "checkpoints" / f".last.ckpt{PARTIAL}").exists()


def test_a_broken_last_ckpt_falls_back_to_the_newest_that_loads(model_dir, reference, tmp_path, caplog):
    main(args(tmp_path, model_dir, "--trainer.max_steps=5"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100_000])  # as a kill during today's copy from $TMPDIR left it
    resume_and_compare(tmp_path, model_dir, reference)
    assert f"skipped {last}: it does not load (truncated, or not a checkpoint (100,000 bytes))" in caplog.text
    assert "resuming from " + str(tmp_path / "checkpoints" / "step5.ckpt") in caplog.text


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
    assert resumable(folder) == (folder / "step3.ckpt", [f"skipped {last}: it does not load (corrupt: its SHA-256 "
                                                         "is not that of the bytes written)"])  # fmt: skip
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


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130(model_dir, other_tmpdir, tmp_path):
    process = launch(tmp_path / "run", model_dir, other_tmpdir)
    wait_for(lambda: logged_steps(tmp_path / "run") >= 3, process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130
    assert last_step(tmp_path / "run") >= 3


FAILURES = {  # how the 2 processes start, which one fails, and what the other does meanwhile
    "fsdp2-process-1-fails": ("lightning", "raise", "1", ["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml")]),
    "ddp-process-0-fails": ("lightning", "raise", "0", ["--trainer.devices=2", "--trainer.strategy=ddp"]),
    "separate-processes-the-other-hangs": ("separate", "raise_hang", "1", ["--trainer.devices=2",
                                                                           "--trainer.strategy=ddp"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAILURES))
def test_an_error_on_one_process_ends_every_process_within_seconds(case, model_dir, tmp_path):
    """One of 2 processes raises inside the gradient accumulation of step 2 (as an out-of-memory would): every
    process ends within 60 s, non-zero, the error's traceback shown, nothing saved after it.

    Lightning's launcher starts process 1 from process 0: process 0 failing must end it. Processes started
    separately (as srun starts them) with the other one hanging where it waits (as in an NCCL collective, which
    a peer's death does not end) are ended by the notice in the process group's store alone.
    """
    launch_kind, mode, rank, layout = FAILURES[case]
    root = tmp_path / "run"
    command = [sys.executable, str(WORKER), mode, rank, "2", *args(root, model_dir, "--trainer.max_steps=5", *layout)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    ranks = [{}] if launch_kind == "lightning" else [group | {"LOCAL_RANK": str(r), "RANK": str(r)} for r in (0, 1)]
    logs = [tmp_path / f"log{i}" for i in range(len(ranks))]
    processes = [subprocess.Popen(command, cwd=REPO, env=env | extra, stdout=open(log, "w"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for extra, log in zip(ranks, logs, strict=True)]  # fmt: skip
    try:
        wait_for((root / f"raised.{rank}").exists, processes[0], timeout=240)
        raised = time.monotonic()
        codes = [process.wait(timeout=60) for process in processes]
        ended = time.monotonic() - raised
        time.sleep(0.5)
        assert [live_processes(p.pid) for p in processes] == [[]] * len(processes)  # none left (zombies aside)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    text = "".join(log.read_text() for log in logs)
    assert all(code != 0 for code in codes), text[-3000:]
    assert f"error: process {rank} of 2 failed after 1 training steps" in text and "Traceback" in text, text[-3000:]
    assert "injected fault: out of memory" in text and "RuntimeError" in text
    if launch_kind == "separate":
        assert "error: process 0 stops: process 1 failed after 1 training steps" in text
    last = root / "checkpoints" / "last.ckpt"
    state = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=False, mmap=not last.is_dir())
    assert state["global_step"] == 1  # the step before the error: nothing was saved after it
    print(f"{case}: every process ended {ended:.1f} s after the error, exit {codes}")


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


# ------------------------------------------------------------------------------------------ bad input
BAD_CONFIGS = [
    ("lr-negative", ["--model.optimizer.init_args.lr=-1"], "model.optimizer"),
    ("lr-nan", ["--model.optimizer.init_args.lr=.nan"], "model.optimizer"),
    ("max-steps", ["--trainer.max_steps=-1"], "trainer.max_steps must be >= 1"),
    ("model-folder", ["--model.model=./no/such/model"], "model: ./no/such/model does not exist"),
    ("data-file", ["--model.task=tasks.ReferenceText", "--model.task.init_args.path=./no/such.jsonl"], "no/such.jsonl"),
    ("remote-checkpoint", ["--ckpt_path=https://example.com/last.ckpt"], "remote checkpoints are refused"),
    ("gpus", ["--trainer.accelerator=gpu", "--trainer.devices=8"], "asks for 8 GPU(s)"),
    ("hub-model", ["--model.model=someone/no-such-model"], "model 'someone/no-such-model' is not in the local cache"),
    ("hub-dataset", ["--model.task=tasks.DeepMath", "--model.task.init_args.path=someone/no-such-data"],
     "dataset 'someone/no-such-data' is not in the local cache"),
    ("last-without-checkpoint", ["--ckpt_path=last"], "has none"),
    ("float16-training", ["--trainer.precision=16-true"], "16-true trains float16 weights, whose squared gradients"),
    ("float16-weights", ["--model.dtype=float16"], "model.dtype=float16 trains float16 weights"),
    ("clip-by-lightning", ["--trainer.gradient_clip_val=1.0"], "use model.max_grad_norm"),
    ("accumulate-by-lightning", ["--trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches is not for"),
    ("fractional-validation", ["--trainer.val_check_interval=0.5"], "val_check_interval must count training steps"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "needle"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_configuration_fails_in_one_line_before_loading(extra, needle, model_dir, tmp_path, capsys,
                                                                 monkeypatch):  # fmt: skip
    if needle.startswith("asks for 8") and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the GPUs")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(SystemExit) as refused:
        main(args(tmp_path / "run", model_dir, "--trainer.max_steps=3", *extra))
    assert refused.value.code == 2
    assert needle in error_line(capsys)
    assert time.perf_counter() - started < 10
    assert not (tmp_path / "run" / "lightning_logs").exists()  # nothing ran


@pytest.mark.slow
def test_a_step_that_does_not_split_over_the_processes_is_refused_before_loading_and_frees_the_folder(
    model_dir, tmp_path
):
    """3 prompts per step over 2 DDP processes: known once the processes exist, refused then in one line on
    each (exit 2), before the model loads; the folder, which holds only that start's config, then takes the
    corrected run without --overwrite."""
    extra = ["--trainer.max_steps=1", "--trainer.devices=2", "--trainer.strategy=ddp", "--model.prompts_per_step=3"]
    refused = subprocess.run(
        [sys.executable, "-m", "sgrpo.fit", *args(tmp_path, model_dir, *extra)],
        cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: invalid configuration: model.prompts_per_step (3) must divide evenly over the 2 "
                     "data-parallel processes"] * 2  # fmt: skip
    assert "Traceback" not in refused.stderr and "Loading weights" not in refused.stderr
    assert [p.name for p in (tmp_path / "lightning_logs").rglob("*") if p.is_file()] == ["config.yaml"]
    main(args(tmp_path, model_dir, "--trainer.max_steps=1"))
    assert last_step(tmp_path) == 1


def test_strategies_whose_sharding_the_rollout_cannot_see_are_refused():
    """FSDP1 (Lightning's ``fsdp``) and DeepSpeed gather weights inside each forward, out of the rollout's
    sight: refused, naming FSDP2. (Lightning builds neither on CPU, so the check is called here directly; the
    supported strategies pass through it in every fit of the suite.)"""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    class DeepSpeedStrategy(DDPStrategy):  # the name Lightning's has (it needs the deepspeed package)
        pass

    for strategy in (SingleDeviceStrategy("cpu"), DDPStrategy(), ModelParallelStrategy()):
        check_strategy(strategy)
    for strategy in (FSDPStrategy(), DeepSpeedStrategy()):
        name = type(strategy).__name__
        with pytest.raises(ConfigError, match=f"trainer.strategy: {name} is not supported; shard with FSDP2"):
            check_strategy(strategy)


def test_an_empty_config_file_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(SystemExit) as refused:
        main(["--config", str(tmp_path / "empty.yaml")])
    assert refused.value.code == 2 and "empty.yaml is empty" in error_line(capsys)


def test_a_10_mb_question_is_dropped_without_being_tokenized():
    tokenizer = build_char_tokenizer()
    seen: list[int] = []
    tokenize = type(tokenizer).__call__

    def spy(self, texts, **kwargs):
        seen.extend(len(t) for t in texts)
        return tokenize(self, texts, **kwargs)

    huge = Example("s:" + "3" * 10_000_000 + "=", "3")
    examples = [Example("s:31=", "13"), huge, Example("s:" + "1" * 60 + "=", "1"), Example("s:2=", "2")]
    type(tokenizer).__call__ = spy
    try:
        kept, dropped = within_limit(examples, tokenizer, 56, "train")
    finally:
        type(tokenizer).__call__ = tokenize
    assert [e.prompt for e in kept] == ["s:31=", "s:2="] and dropped == 2
    assert max(seen) < 1000  # the 10 MB text never reached the tokenizer


def test_prompts_over_the_model_positions_are_dropped_and_counted(model_dir, tmp_path):
    from transformers import AutoConfig

    assert prompt_limit(type("M", (), {"config": AutoConfig.from_pretrained(model_dir)}), None, 8) == 64 - 8
    # sort prompts of 3 and 5 digits: "s:123=" is 6 tokens, "s:12345=" 8; half of the 256 are over 6
    cli = main(args(tmp_path, model_dir, "--trainer.max_steps=2", "--model.max_prompt_tokens=6"))
    assert cli.model.prompts_dropped == 128
    assert read_run_metrics(tmp_path)["train/prompts_dropped"] == [(0, 128.0), (1, 128.0)]


class AlwaysFails(Reward):
    """A reward whose scoring always raises."""

    name = "always_fails"

    def score(self, examples, completions):
        raise RuntimeError("the grader is not installed")


def test_a_reward_that_always_fails_stops_the_run(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(args(tmp_path, model_dir, "--trainer.max_steps=10", "--model.reward_failure_steps=2",
                  "--model.task.init_args.reward=tests.test_faults.AlwaysFails"))  # fmt: skip
    assert stopped.value.code == 1
    line = error_line(capsys)
    assert "the reward failed for 16 of 16 completions" in line and "2 steps in a row" in line
    assert last_step(tmp_path) == 1  # one step trained on zeros, then it stopped
