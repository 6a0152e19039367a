"""The run folder's lock: exclusive while held, naming its holder, and naming nobody once released."""

from __future__ import annotations

import os

import pytest

from sgrpo.run.folders import LOCK_FILE, RunRefused, lock_run, unlock_run


def test_a_held_lock_names_its_process_and_a_released_one_names_nobody(tmp_path):
    lock = lock_run(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(RunRefused, match=rf"in use by pid {os.getpid()} on "):
        lock_run(tmp_path)  # a second handle is a second lock holder: refused while the first holds it
    unlock_run(lock)
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean exit leaves no stale 'pid N' naming a dead process
    unlock_run(lock_run(tmp_path))  # and the folder can be claimed again


def test_the_progress_bar_counts_the_runs_steps_after_a_resume(monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from sgrpo.run.progress import StepProgressBar

    bar, seen = StepProgressBar(), []
    bar._trainer = SimpleNamespace(max_steps=6, global_step=4)  # resumed at step 3, one step done since
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda *args, batch_idx=None: seen.append(args[-1]))
    bar.on_train_batch_end(bar._trainer, None, None, None, batch_idx=0)  # Lightning's index in the resumed loader
    assert bar.total_train_batches == 6 and seen == [3]  # shown as 4/6 (it was 1/3, and 6/2 by the end)


def test_keep_last_prunes_a_run_that_moved_to_another_folder(tmp_path):
    import shutil
    from pathlib import Path

    from sgrpo.fit import main

    def fit(root, *extra):
        config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
        main(["--config", str(config), f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
              "--checkpoint_every=1", "--keep_last=2", "--trainer.limit_val_batches=0", *extra])  # fmt: skip

    fit(tmp_path / "a", "--trainer.max_steps=3")
    shutil.move(tmp_path / "a", tmp_path / "b")  # Lightning's record of step2/step3 names the old folder
    fit(tmp_path / "b", "--trainer.max_steps=5", "--ckpt_path=last")
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("*.ckpt")) == [
        "last.ckpt", "step4.ckpt", "step5.ckpt"]  # fmt: skip  (step2 and step3 stayed, before)


def test_a_resume_with_a_smaller_keep_last_prunes_to_it_and_keeps_pruning(tmp_path):
    """Written with ``keep_last: null`` (every step kept), resumed with ``--keep_last=2``: Lightning deletes its
    oldest only while it holds exactly that many, so the 3 steps already there (plus each new one) stayed for good;
    now the oldest go as the fit starts, and every new step prunes as usual. Their checksums go with them."""
    from pathlib import Path

    from sgrpo.fit import main

    def fit(keep, *extra):
        config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
        main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
              "--checkpoint_every=1", f"--keep_last={keep}", "--trainer.limit_val_batches=0", *extra])  # fmt: skip

    fit("null", "--trainer.max_steps=3")
    fit("2", "--trainer.max_steps=5", "--ckpt_path=last")
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "step4.ckpt", "step5.ckpt"]
    assert sorted(p.name for p in folder.glob(".step*.sha256")) == [".step4.ckpt.sha256", ".step5.ckpt.sha256"]


def test_a_full_disk_at_run_time_is_one_line_naming_the_folder_and_the_fix(tmp_path, monkeypatch, capsys):
    import errno
    from pathlib import Path

    from sgrpo.fit import main
    from sgrpo.run.checkpoints import AtomicCheckpointIO
    from sgrpo.run.faults import disk_fault

    saves = []

    def full_after_one(self, checkpoint, path, storage_options=None):
        saves.append(path)
        if len(saves) > 1:  # as torch.save reports it: its RuntimeError raised while handling the OSError
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None

        return original(self, checkpoint, path, storage_options)

    original = AtomicCheckpointIO.save_checkpoint
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", full_after_one)
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    with pytest.raises(SystemExit) as stopped:
        main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
              "--checkpoint_every=1", "--trainer.max_steps=4", "--trainer.limit_val_batches=0"])  # fmt: skip
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "Traceback" not in err  # it was two chained tracebacks
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: No space left on device while the run wrote into {tmp_path}: free space there (or use "
        "--trainer.default_root_dir on another disk); then resume with --ckpt_path last: its newest checkpoint was "
        "left as it was"]  # fmt: skip
    assert (tmp_path / "checkpoints" / "step1.ckpt").is_file()  # the one write that fit, kept
    assert disk_fault(RuntimeError("another error")) is None


def test_a_run_resumed_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, caplog):
    """Resumed from step 2 of a folder holding steps 1-5: steps 3-5 and ``last.ckpt`` (step 5) belong to the run it
    branched from, and ``--ckpt_path last`` would have taken them (the newest step) after a kill before this run
    caught up. They move to ``checkpoints/abandoned_step2/`` with their checksums, and ``last`` is this run's."""
    import logging
    from pathlib import Path

    from sgrpo.fit import main
    from sgrpo.run.checkpoints import checkpoint_step, resumable

    def fit(*extra):
        config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
        main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
              "--checkpoint_every=1", "--keep_last=null", "--trainer.limit_val_batches=0", *extra])  # fmt: skip

    folder = tmp_path / "checkpoints"
    fit("--trainer.max_steps=5")
    with caplog.at_level(logging.WARNING, logger="sgrpo.run.checkpoints"):
        fit("--trainer.max_steps=3", f"--ckpt_path={folder / 'step2.ckpt'}")
    aside = folder / "abandoned_step2"
    assert sorted(p.name for p in aside.glob("*.ckpt")) == ["last.ckpt", "step3.ckpt", "step4.ckpt", "step5.ckpt"]
    assert len(list(aside.glob(".*.sha256"))) == 4
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "step1.ckpt", "step2.ckpt", "step3.ckpt"]
    path, _ = resumable(folder)
    assert path.name == "last.ckpt" and checkpoint_step(path) == 3
    assert any("resumed at step 2, before the newest checkpoints" in r.getMessage() for r in caplog.records)
