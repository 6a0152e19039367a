"""SIGTERM and Ctrl-C land anywhere in a fit of configs/tiny.yaml; the resume continues it exactly.

Each signal is sent by the process to itself from a hook at one landing point (mid-step, during a validation,
just after one, during a checkpoint write), so the point is the same every time. The interrupted run then
resumes with ``--ckpt_path last`` to the end; its ``metrics.jsonl`` must hold the uninterrupted run's rows,
value for value (timings aside). A resume that fails to load (another optimiser, LoRA added) writes nothing.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch

from sgrpo.eval.metrics_file import read_metrics_file
from sgrpo.fit import main
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.policy import GRPOPolicy
from sgrpo.run.checkpoints import AtomicCheckpointIO
from sgrpo.train.update import PolicyUpdate

REPO = Path(__file__).resolve().parents[1]
STEPS = 4  # validation after steps 2 and 4
TIMINGS = ("train/time/", "train/throughput/")


def args(root: Path, model_dir: str, *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        f"--model.model={model_dir}", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=2", "--checkpoint_every=2", *extra,
    ]  # fmt: skip


def rows(root: Path) -> dict[str, list[tuple[int, float]]]:
    series = read_metrics_file(root / "metrics.jsonl")
    return {key: points for key, points in series.items() if not key.startswith(TIMINGS)}


def last_step(root: Path) -> int:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, mmap=True)["global_step"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict[str, list[tuple[int, float]]]:
    root = tmp_path_factory.mktemp("reference")
    main(args(root, model_dir))
    return rows(root)


def signal_at(monkeypatch, cls, name: str, signum: int, when) -> None:
    """Send ``signum`` to this process on the first call of ``cls.name`` where ``when(self)`` holds, before it runs."""
    original, sent = getattr(cls, name), []

    def wrapped(self, *a, **k):
        if not sent and when(self):
            sent.append(os.getpid())
            os.kill(os.getpid(), signum)
        return original(self, *a, **k)

    monkeypatch.setattr(cls, name, wrapped)


def in_step(n: int):  # training step n (1-based) is under way: rollout_step counts the steps done
    return lambda policy: policy.rollout_step == n - 1


def after_step(n: int):
    return lambda obj: getattr(obj, "trainer", None) is None or obj.trainer.global_step == n


LANDINGS = {  # (where, the signal, the step whose end last.ckpt must hold)
    # inside step 2's update (its first optimiser step under way): step 2 runs to its end, saved there
    "sigterm-mid-update": ((PolicyUpdate, "on_before_optimizer_step", in_step(2)), signal.SIGTERM, 2),
    "ctrl-c-mid-update": ((PolicyUpdate, "on_before_optimizer_step", in_step(2)), signal.SIGINT, 2),
    "sigterm-during-validation": ((GRPOPolicy, "validation_step", after_step(2)), signal.SIGTERM, 2),
    "ctrl-c-during-validation": ((GRPOPolicy, "validation_step", after_step(2)), signal.SIGINT, 2),
    "sigterm-just-after-validation": ((GRPOPolicy, "on_validation_end", after_step(2)), signal.SIGTERM, 2),
    "sigterm-during-checkpoint-write": ((AtomicCheckpointIO, "save_checkpoint", lambda io: True), signal.SIGTERM, 2),
    # the state is still step 2's end (step 3's rollout, or its gradients before the first optimiser step):
    # saved at once, step 3 not run to its end (a DeepMath step outlasts SLURM's 30 s between SIGTERM and SIGKILL)
    "sigterm-during-rollout": ((GRPOPolicy, "sample", in_step(3)), signal.SIGTERM, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("landing", list(LANDINGS))
def test_a_signal_anywhere_resumes_to_the_uninterrupted_runs_metrics(landing, model_dir, reference, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    (cls, name, when), signum, saved = LANDINGS[landing]
    with monkeypatch.context() as patched:
        signal_at(patched, cls, name, signum, when)
        with pytest.raises(SystemExit) as stopped:
            main(args(tmp_path, model_dir))
    assert stopped.value.code == 128 + signum
    assert last_step(tmp_path) == saved  # the end of the last complete step
    main(args(tmp_path, model_dir, "--ckpt_path=last"))
    got = rows(tmp_path)
    assert sorted(got) == sorted(reference)
    for key, points in reference.items():
        assert got[key] == points, key  # row by row, value for value


def test_an_error_inside_an_update_saves_nothing(model_dir, tmp_path, monkeypatch):
    """An error after the first of a step's two optimiser steps (num_minibatches 2): the state is half a step,
    so last.ckpt stays the previous step's, byte for byte (it used to get those weights with that step's
    counter, and a resume applied the first optimiser step twice)."""
    extra = ["--model.num_minibatches=2", "--checkpoint_every=1", "--trainer.val_check_interval=100"]
    main(args(tmp_path, model_dir, "--trainer.max_steps=2", *extra))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    step, calls = PolicyUpdate._optimizer_step, []

    def fails_second(self, *a, **k):
        calls.append(self.rollout_step)
        if len(calls) == 2:
            raise RuntimeError("out of memory in the second optimiser step")
        return step(self, *a, **k)

    monkeypatch.setattr(PolicyUpdate, "_optimizer_step", fails_second)
    with pytest.raises(RuntimeError, match="second optimiser step"):
        main(args(tmp_path, model_dir, "--trainer.max_steps=4", "--ckpt_path=last", *extra))
    assert calls == [2, 2] and last.read_bytes() == before


def test_a_second_ctrl_c_stops_at_once_saving_only_a_steps_end(model_dir, tmp_path, monkeypatch):
    """Ctrl-C twice inside step 3's update (its optimiser step under way): the fit stops there (exit 130) and saves
    nothing, the state being half a step: last.ckpt stays step 2's."""
    original = PolicyUpdate.on_before_optimizer_step

    def twice(self, *a, **k):
        if self.rollout_step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # recorded: the update is under way
            os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here
        return original(self, *a, **k)

    monkeypatch.setattr(PolicyUpdate, "on_before_optimizer_step", twice)
    with pytest.raises(SystemExit) as stopped:
        main(args(tmp_path, model_dir, "--checkpoint_every=2"))
    assert stopped.value.code == 130
    assert last_step(tmp_path) == 2


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_loses_no_metrics_row(model_dir, reference, tmp_path, monkeypatch):
    """A full disk during step 2's checkpoint: that step's metrics are already written, the half-written file is
    removed, nothing else is saved after the error; the resume from step 1 continues the run exactly."""
    save = torch.save

    def full_once(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("global_step") == 2 and not failed:
            failed.append(f.name)
            f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *a, **k)

    failed: list[str] = []
    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", full_once)
        with pytest.raises(SystemExit) as stopped:  # one line naming the folder and the fix (tests/test_runs.py)
            main(args(tmp_path, model_dir, "--checkpoint_every=1"))
    assert stopped.value.code == 1
    assert failed and not Path(failed[0]).exists()  # the partial file, removed
    assert last_step(tmp_path) == 1
    assert [step for step, _ in rows(tmp_path)["train/reward"]] == [0, 1]  # step 2 is logged at 1
    main(args(tmp_path, model_dir, "--checkpoint_every=1", "--ckpt_path=last"))
    got = rows(tmp_path)
    assert sorted(got) == sorted(reference)
    for key, points in reference.items():
        assert got[key] == points, key


def test_a_failed_resume_writes_nothing_and_says_why_in_one_line(model_dir, tmp_path, capsys):
    """Another optimiser (SGD has no Adam state: KeyError 'momentum') or LoRA added (other parameter groups):
    the load fails; last.ckpt keeps its bytes, and the error is one line, exit 2."""
    main(args(tmp_path, model_dir, "--trainer.max_steps=2", "--trainer.val_check_interval=100"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    changes = {
        "optimizer": ["--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=0.01",
                      "--model.optimizer.init_args.momentum=0.9"],
        "lora": ["--model.peft.rank=4"],
    }  # fmt: skip
    for change in changes.values():
        with pytest.raises(SystemExit) as refused:
            main(args(tmp_path, model_dir, "--trainer.max_steps=3", "--ckpt_path=last", *change))
        assert refused.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert f"--ckpt_path {last} does not load into this run" in lines[0] and "left as it was" in lines[0]
        assert last.read_bytes() == before
    assert sorted(p.name for p in last.parent.glob("[!.]*")) == ["last.ckpt", "step2.ckpt"]


def test_a_refused_resume_from_an_older_checkpoint_moves_and_prunes_nothing(model_dir, tmp_path, capsys):
    """Resumed from step 1 of steps 1-2 with another optimiser (``--resume_changes allow``, so the load passes):
    refused (exit 2) as the fit starts. Setting the
    newer checkpoints aside (``abandoned_step1/``) and pruning to ``keep_last`` came first, so the refused run
    still moved step 2 and ``last.ckpt`` out of the folder; now nothing is moved, pruned or written."""
    main(args(tmp_path, model_dir, "--trainer.max_steps=2", "--checkpoint_every=1", "--keep_last=null",
              "--trainer.val_check_interval=100"))  # fmt: skip
    folder = tmp_path / "checkpoints"
    before = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert {"last.ckpt", "step1.ckpt", "step2.ckpt"} <= set(before)
    sgd = ["--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=0.01"]
    with pytest.raises(SystemExit) as refused:
        main(args(tmp_path, model_dir, "--trainer.max_steps=3", f"--ckpt_path={folder / 'step1.ckpt'}",
                  "--checkpoint_every=1", "--keep_last=1", "--resume_changes=allow", *sgd))  # fmt: skip
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "trained with torch.optim.adamw.AdamW" in err, err[-2000:]
    assert {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_ctrl_c_again_during_the_stops_teardown_exits_130_without_a_traceback(model_dir, tmp_path, monkeypatch,
                                                                             capsys):  # fmt: skip
    """The first Ctrl-C inside step 2's update stops at its end; the second lands in the teardown (a logger's
    finalize), where sgrpo's handler was gone: a KeyboardInterrupt raised there ended the process with a traceback,
    or by SIGINT itself. It exits 130 with one line, step 2 saved."""
    from lightning.pytorch.loggers import CSVLogger

    signal_at(monkeypatch, PolicyUpdate, "on_before_optimizer_step", signal.SIGINT, in_step(2))
    signal_at(monkeypatch, CSVLogger, "finalize", signal.SIGINT, lambda logger: True)
    before = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN where a shell started the tests in background
    try:
        with pytest.raises(SystemExit) as stopped:
            main(args(tmp_path, model_dir, "--checkpoint_every=100"))
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C escaped as a KeyboardInterrupt (a traceback, then death by SIGINT)")
    assert stopped.value.code == 130
    assert last_step(tmp_path) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Ctrl-C again: stopping now" in err, err[-2000:]
    assert signal.getsignal(signal.SIGINT) is before  # put back for whatever runs next


class Killed(BaseException):
    """Ends the in-process fit where a kill -9 landed (its files were copied at that instant)."""


@pytest.mark.slow  # a fit and its resume, as the landings above
def test_a_kill_9_during_the_final_steps_last_ckpt_link_resumes_its_validation(model_dir, reference, tmp_path,
                                                                                monkeypatch):  # fmt: skip
    """kill -9 as the final step's ``last.ckpt`` link begins (2 of 20 trials of benchmarks/kill_trials.py): the run
    folder as the kill leaves it (copied at that instant: what a kill leaves on disk) holds ``step4.ckpt``, whose
    validation is still due, and ``last.ckpt`` at step 2. ``--ckpt_path last`` took step 4, stopped at once at
    ``max_steps`` and never ran that validation (its rows were lost), and ``last.ckpt`` stayed step 2's. Now the
    resume runs the validation it owes and makes ``last.ckpt`` hold step 4 again."""
    import shutil

    import sgrpo.run.saving as saving

    root, killed = tmp_path / "run", tmp_path / "killed"
    link = saving.link_checkpoint

    def kill_at_the_final_link(source: Path, target: Path) -> None:
        if target.name == "last.ckpt" and source.name == f"step{STEPS}.ckpt":
            shutil.copytree(root, killed, ignore=shutil.ignore_patterns(".sgrpo.lock"))  # the lock dies with it
            raise Killed
        link(source, target)

    monkeypatch.setattr(saving, "link_checkpoint", kill_at_the_final_link)
    with pytest.raises(Killed):
        main(args(root, model_dir))
    monkeypatch.setattr(saving, "link_checkpoint", link)
    assert last_step(killed) == 2 and (killed / "checkpoints" / f"step{STEPS}.ckpt").exists()
    main(args(killed, model_dir, "--ckpt_path=last"))
    got = rows(killed)
    assert sorted(got) == sorted(reference)
    for key, points in reference.items():
        assert got[key] == points, key  # the final validation's rows included
    folder = killed / "checkpoints"
    assert last_step(killed) == STEPS and (folder / "last.ckpt").stat().st_ino == (folder / "step4.ckpt").stat().st_ino


def test_a_stop_after_scoring_saves_the_reward_streak_of_the_last_step_end(model_dir, tmp_path, monkeypatch):
    """A reward that always fails, ``reward_failure_steps`` 3: the uninterrupted run trains and logs steps 1-3, then
    stops. SIGTERM after step 2's scoring saves step 1's end at once (a fresh write: no step-end checkpoint of step 1
    to link to). Its checkpoint held the streak step 2 had already counted (2), so the resumed run redid step 2,
    counted it again and gave up one step early. The checkpoint now holds the streak of step 1's end (1), and the
    resumed run stops where the uninterrupted one does."""
    from sgrpo.eval.report import read_run_metrics

    failing = ["--model.reward_failure_steps=3", "--model.task.init_args.reward=tests.test_faults_input.AlwaysFails",
               "--trainer.max_steps=10", "--checkpoint_every=100", "--trainer.val_check_interval=100"]  # fmt: skip
    with monkeypatch.context() as patched:
        signal_at(patched, PolicyUpdate, "update", signal.SIGTERM, in_step(2))
        with pytest.raises(SystemExit) as stopped:
            main(args(tmp_path, model_dir, *failing))
    assert stopped.value.code == 128 + signal.SIGTERM
    last = tmp_path / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 1 and saved["sgrpo"]["guards"]["reward_failure_streak"] == 1
    with pytest.raises(SystemExit) as gave_up:
        main(args(tmp_path, model_dir, *failing, "--ckpt_path=last"))
    assert gave_up.value.code == 1
    assert [step for step, _ in read_run_metrics(tmp_path)["train/reward/failures"]] == [0, 1, 2]


def test_a_signal_while_a_validation_s_metrics_are_logged_keeps_one_entry_per_validation(model_dir, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """SIGTERM while Lightning logs step 2's validation metrics (after the policy recorded the validation, before the
    checkpoint callback marked it done): step 2 is saved with its validation still due, so the resumed run validates
    step 2 again (no step-end checkpoint of step 2 to link to: the save is a fresh write holding the record). The
    record was appended a second time: the report's accuracy table showed step 2 twice."""
    from sgrpo.eval.metrics_file import MetricsFile

    original, sent = MetricsFile.log_metrics, []

    def log_metrics(self, metrics, step=None):
        if not sent and any(key.startswith("val/") for key in metrics):
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, metrics, step)

    with monkeypatch.context() as patched:
        patched.setattr(MetricsFile, "log_metrics", log_metrics)
        with pytest.raises(SystemExit) as stopped:
            main(args(tmp_path, model_dir, "--checkpoint_every=100"))
    assert stopped.value.code == 128 + signal.SIGTERM and last_step(tmp_path) == 2
    main(args(tmp_path, model_dir, "--checkpoint_every=100", "--ckpt_path=last"))
    history = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["sgrpo"]["val_history"]
    assert [entry["step"] for entry in history] == [2]  # as the uninterrupted run's: saved before step 4's validation
