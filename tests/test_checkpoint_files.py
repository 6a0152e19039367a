"""Checkpoint files and what a resume takes from them: the newest step that loads (not the newest name), a sharded
swap cut between its renames recovered, one write per periodic save (``last.ckpt`` a hard link), a resume that
changes precision, data or ``max_steps`` refused, an export that lands whole or not at all, no run in the working
directory. (2 processes that would resume different files: tests/test_sharded.py.)"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from sgrpo.run.checkpoints import (
    OLD,
    PARTIAL,
    AtomicCheckpointIO,
    checkpoint_problem,
    checkpoint_step,
    hidden_name,
    link_checkpoint,
    remove_path,
    remove_unfinished,
    replace_folder,
    resumable,
    tidy_resumed,
)
from sgrpo.run.resume import experiment_changes, experiment_record

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def fit_args(root: Path, *extra: str) -> list[str]:
    return ["--config", TINY, f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
            "--trainer.limit_val_batches=0", *extra]  # fmt: skip


def lightning_file(path: Path, step: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "pytorch-lightning_version": "2"}, path)


def sharded_folder(path: Path, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": step, "pytorch-lightning_version": "2"}, path / "meta.pt")


def test_last_is_the_newest_step_that_loads_not_the_newest_name(tmp_path):
    """After a failed ``last.ckpt`` write, ``last.ckpt`` holding step 2 lay beside a good ``step4.ckpt``: the resume
    took step 2. A newer step that does not load is skipped, saying why."""
    for step in (2, 4):
        lightning_file(tmp_path / f"step{step}.ckpt", step)
    lightning_file(tmp_path / "last.ckpt", 2)
    assert resumable(tmp_path) == (tmp_path / "step4.ckpt", [])
    lightning_file(tmp_path / "last.ckpt", 4)  # equal steps: last.ckpt (a link to the other)
    assert resumable(tmp_path) == (tmp_path / "last.ckpt", [])
    lightning_file(tmp_path / "step6.ckpt", 6)
    (tmp_path / "step6.ckpt").write_bytes((tmp_path / "step6.ckpt").read_bytes()[:-20])  # its index cut off
    path, skipped = resumable(tmp_path)
    assert path == tmp_path / "last.ckpt" and len(skipped) == 1 and "step6.ckpt: it does not load" in skipped[0]
    assert checkpoint_step(tmp_path / "step6.ckpt") is None and checkpoint_step(tmp_path / "step4.ckpt") == 4


@pytest.mark.parametrize("new_complete", [True, False])
def test_a_sharded_swap_cut_between_its_renames_is_recovered_before_cleaning(tmp_path, monkeypatch, new_complete):
    """A kill between ``last.ckpt -> .last.ckpt.old`` and ``.last.ckpt.partial -> last.ckpt`` left no ``last.ckpt``,
    and the next start deleted both hidden copies. Now it puts the new copy back (the old one if the new is
    incomplete), then cleans."""
    folder, target = tmp_path, tmp_path / "last.ckpt"
    sharded_folder(target, 2)
    staged = hidden_name(target, PARTIAL)
    sharded_folder(staged, 4)
    if not new_complete:
        next(staged.glob("*.distcp")).write_bytes(b"")
    replace = os.replace

    def killed_after_the_first_rename(src, dst):
        if Path(src) == staged:
            raise KeyboardInterrupt  # as kill -9 there
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        replace_folder(staged, target)
    monkeypatch.setattr(os, "replace", replace)
    assert not target.exists() and hidden_name(target, OLD).is_dir()
    remove_unfinished(folder)  # what the next start does first
    assert checkpoint_problem(target) == "" and checkpoint_step(target) == (4 if new_complete else 2)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def test_a_periodic_save_writes_once_and_last_ckpt_links_to_it(tmp_path, monkeypatch):
    """``stepN.ckpt`` and ``last.ckpt`` were two full writes (each hashed in the training thread): one write per step
    now, ``last.ckpt`` a hard link with the same checksum, still whole once ``keep_last`` prunes its ``stepN.ckpt``."""
    from sgrpo.fit import main

    writes = []
    save = AtomicCheckpointIO.save_checkpoint

    def counted(self, checkpoint, path, storage_options=None):
        writes.append(Path(path).name)
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counted)
    main(fit_args(tmp_path, "--trainer.max_steps=3", "--checkpoint_every=1", "--keep_last=1"))
    folder = tmp_path / "checkpoints"
    assert writes == ["step1.ckpt", "step2.ckpt", "step3.ckpt"]  # was: step1, last, step2, last, step3, last
    assert (folder / "last.ckpt").stat().st_ino == (folder / "step3.ckpt").stat().st_ino
    assert sorted(p.name for p in folder.glob("[!.]*")) == ["last.ckpt", "step3.ckpt"]
    assert resumable(folder) == (folder / "last.ckpt", [])  # its recorded checksum matches: it loads
    assert checkpoint_step(folder / "last.ckpt") == 3


def test_a_linked_checkpoint_shares_the_bytes_and_outlives_its_source(tmp_path):
    """``link_checkpoint`` of a file (its recorded checksum carried over) and of a sharded folder (file by file)."""
    for make, name in ((lightning_file, "step3.ckpt"), (sharded_folder, "shards3.ckpt")):
        source, target = tmp_path / name, tmp_path / f"last_{name}"
        make(source, 3)
        link_checkpoint(source, target)
        pairs = [(source, target)] if source.is_file() else [(f, target / f.name) for f in source.iterdir()]
        assert all(a.stat().st_ino == b.stat().st_ino for a, b in pairs) and len(pairs) >= 2 - source.is_file()
        remove_path(source)  # as keep_last prunes it
        assert checkpoint_problem(target) == "" and checkpoint_step(target) == 3
    assert not list(tmp_path.glob(f".*{PARTIAL}"))


def test_a_resume_records_precision_and_data_content(tmp_path):
    """Outside the model block, another ``trainer.precision`` or another data file under the same path changed the
    experiment silently; a checkpoint from before they were recorded is not refused for lacking them."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n')
    model = {"task": {"class_path": "tasks.data.FileTask", "init_args": {"path": str(data), "kind": "sort"}}}
    before = experiment_record(model, 0, "32-true")
    assert experiment_changes(before, experiment_record(model, 0, "32-true")) == []
    changed = experiment_changes(before, experiment_record(model, 0, "64-true"))
    assert changed == ['trainer.precision: "32-true" -> "64-true"']
    data.write_text('{"prompt": "b", "answer": "2"}\n')  # same path, same size, other content
    (line,) = experiment_changes(before, experiment_record(model, 0, "32-true"))
    assert line.startswith("model.task.init_args.path@content: ")
    older = {k: v for k, v in before.items() if k != "trainer.precision" and not k.endswith("@content")}
    assert experiment_changes(older, experiment_record(model, 0, "64-true")) == []


@pytest.mark.slow
def test_an_export_a_signal_cuts_lands_whole_or_not_at_all_and_a_resume_re_exports(tmp_path, monkeypatch, capsys):
    """SIGTERM during the end-of-fit export left ``hf_model/`` with only ``config.json`` and no message. Now nothing is
    put in place, the signal says so (exit 143), a resume past ``max_steps`` is refused (it would stop at once and
    overwrite the export), and ``--ckpt_path last`` with the run's ``max_steps`` exports it whole; so is a resume
    with another ``trainer.precision`` refused (it re-exported the policy as float64)."""
    from transformers import PreTrainedModel

    from sgrpo.fit import main

    save = PreTrainedModel.save_pretrained

    def signalled(self, path, *args, **kwargs):
        self.config.save_pretrained(path)
        os.kill(os.getpid(), signal.SIGTERM)  # as the scheduler's, in the middle of the export
        return save(self, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", signalled)
    with pytest.raises(SystemExit) as stopped:
        main(fit_args(tmp_path, "--trainer.max_steps=2"))
    export = tmp_path / "hf_model"
    assert stopped.value.code == 143 and "SIGTERM during the export to" in capsys.readouterr().err
    assert not export.exists() and not hidden_name(export, PARTIAL).exists()
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    for refused, why in [("--trainer.max_steps=1", "past --trainer.max_steps=1"),
                         ("--trainer.precision=64-true", 'trainer.precision: "32-true" -> "64-true"')]:  # fmt: skip
        args = ["--trainer.max_steps=2", "--ckpt_path=last", refused]
        with pytest.raises(SystemExit) as stopped:
            main(fit_args(tmp_path, *args))
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert stopped.value.code == 2 and len(errors) == 1 and why in errors[0], errors
        assert not export.exists()
    main(fit_args(tmp_path, "--trainer.max_steps=2", "--ckpt_path=last"))
    assert {"config.json", "model.safetensors"} <= {p.name for p in export.iterdir()}
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_an_empty_run_folder_name_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """``trainer.default_root_dir: ""`` wrote the run into the working directory, where ``--overwrite true`` would
    delete files."""
    from sgrpo.fit import main

    monkeypatch.chdir(tmp_path)
    for empty in ("", " "):
        with pytest.raises(SystemExit) as refused:
            main(["--config", TINY, f"--trainer.default_root_dir={empty}", "--trainer.max_steps=1"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert refused.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
        assert "trainer.default_root_dir=" in errors[0] and "names no folder" in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


@pytest.mark.parametrize("keep, dropped", [(0, ["step1.ckpt", "step2.ckpt"]), (1, ["step1.ckpt", "step2.ckpt"]),
                                           (2, ["step1.ckpt"]), (-1, [])])  # fmt: skip
def test_a_resume_with_a_smaller_keep_last_deletes_the_oldest_never_the_one_resumed_from(tmp_path, keep, dropped):
    """``keep`` is Lightning's ``save_top_k``: ``--keep_last 0`` (0, only ``last.ckpt``) used to delete nothing, as
    "keep all" (-1) does, so a folder written under a larger ``keep_last`` kept its old checkpoints for good."""
    for n in (1, 2, 3):
        (tmp_path / f"step{n}.ckpt").write_bytes(b"x")
    drop, kept = tidy_resumed(tmp_path, 3, tmp_path / "step3.ckpt", keep, leader=True, barrier=lambda: None)
    assert sorted(Path(p).name for p in drop) == dropped
    assert {Path(p).name for p in kept} >= ({"step3.ckpt"} if keep != 0 else set())
