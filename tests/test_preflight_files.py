"""Preflight refusals of the files a run reads or writes (a bad data file, a YAML syntax error, a read-only run
folder, a torch file that is not a checkpoint), values as parsed, and an evaluation into a run folder (split from
tests/test_preflight.py): one line naming the file or key and the fix, exit 2, before any model loads."""

from __future__ import annotations

import pytest
import torch

from sgrpo.fit import main
from tests.test_preflight import TINY, refusal
from tests.test_preflight import model_dir as model_dir  # the module's tiny model (a fixture)

# -------------------------------------------------------------------------------- files the run reads or writes
DATA_FILES = [  # name, bytes, what the one line says
    ("missing.jsonl", b'{"prompt": "s:31=", "reference": "13"}\n{"prompt": "s:2="}\n',
     "missing.jsonl, line 2, column 'reference': missing in this row"),
    ("renamed.jsonl", b'{"prompt": "s:31=", "answer": "13"}\n',
     "column 'reference': missing; the source has columns ['answer', 'prompt']"),
    ("empty.jsonl", b"", "empty.jsonl holds no rows"),
    ("latin1.jsonl", '{"prompt": "caf\u00e9", "reference": "x"}\n'.encode("latin-1"), "latin1.jsonl:1: not UTF-8 text"),
    ("broken.jsonl", b'{"prompt": "a", "reference": "b"}\n{"prompt": \n', "broken.jsonl:2: not a JSON object per line"),
    ("broken.json", b'[{"prompt": "a", "reference": "b"},\n oops]\n', "broken.json:2: not a JSON array of objects"),
    ("broken.parquet", b"PAR1 not parquet", "broken.parquet: not a readable parquet file"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "data", "needle"), DATA_FILES, ids=[d[0] for d in DATA_FILES])
def test_a_bad_data_file_fails_in_one_line_naming_it(name, data, needle, model_dir, tmp_path, capsys):
    (tmp_path / name).write_bytes(data)
    line = refusal(tmp_path, model_dir, capsys, "--model.task=tasks.ReferenceText",
                   f"--model.task.init_args.path={tmp_path / name}")  # fmt: skip
    assert line.startswith("error: invalid configuration: model.task.init_args.path: ") and needle in line


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [3\nmodel:\n  model: x\n")
    with pytest.raises(SystemExit) as refused:
        main(["--config", str(bad)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1
    assert f"--config {bad}:3:6: not valid YAML" in lines[0] and "opened on line 2" in lines[0]


@pytest.fixture
def read_only(tmp_path):
    """A folder this process cannot write: mode 555, and for root (whom modes do not stop) immutable."""
    import os
    import subprocess

    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        probe = folder / "probe"
        try:
            probe.mkdir()
            probe.rmdir()
            pytest.skip("cannot make a read-only folder here")
        except OSError:
            pass
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


@pytest.mark.parametrize("inside", [False, True], ids=["the-folder", "a-folder-below"])
def test_a_read_only_run_folder_is_refused_in_one_line(inside, read_only, model_dir, capsys):
    root = read_only / "run" if inside else read_only
    line = refusal(read_only.parent, model_dir, capsys, f"--trainer.default_root_dir={root}")
    assert f"trainer.default_root_dir={root}: cannot write in {read_only}" in line


def test_a_torch_file_that_is_not_a_lightning_checkpoint_is_refused_or_skipped(model_dir, tmp_path, capsys):
    """--ckpt_path to it: one line; --ckpt_path last: skipped with a warning, the next checkpoint resumes."""
    from sgrpo.run.checkpoints import NOT_LIGHTNING, checkpoint_problem, resumable

    plain = tmp_path / "weights.pt"
    torch.save({"weights": torch.ones(3)}, plain)
    assert checkpoint_problem(plain) == NOT_LIGHTNING
    line = refusal(tmp_path, model_dir, capsys, f"--ckpt_path={plain}")
    assert f"--ckpt_path {plain} does not load (a torch file, but not a Lightning checkpoint" in line
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"pytorch-lightning_version": "2", "state_dict": {}}, folder / "step1.ckpt")
    torch.save({"weights": torch.ones(3)}, folder / "step2.ckpt")
    path, skipped = resumable(folder)
    assert path == folder / "step1.ckpt" and skipped == [f"skipped {folder / 'step2.ckpt'}: it does not load "
                                                         f"({NOT_LIGHTNING})"]  # fmt: skip


# ---------------------------------------------------------------------------------------- values as parsed
def test_limit_val_batches_counts_batches(model_dir, tmp_path):
    """configs/tiny.yaml's ``limit_val_batches: 1`` is one batch: 4 of its 16 validation prompts at 4 per batch
    (it was read as 1.0, all 4 batches: Python's typing cache gave Lightning's Union[int, float] as Fabric's
    Union[float, int]). A float stays a fraction."""
    cli = main([
        "--config", TINY, f"--trainer.default_root_dir={tmp_path}", f"--model.model={model_dir}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_steps=1",
        "--trainer.val_check_interval=1", "--model.val_prompts_per_batch=4",
    ])  # fmt: skip
    assert cli.trainer.limit_val_batches == 1 and type(cli.trainer.limit_val_batches) is int
    assert [result["prompts"] for result in cli.model.val_history] == [4]
    from sgrpo.fit import parse

    fraction = parse(["--config", TINY, f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0.5",
                      "--trainer.limit_test_batches=2"])  # fmt: skip
    assert fraction.trainer.limit_val_batches == 0.5 and type(fraction.trainer.limit_test_batches) is int


# ---------------------------------------------------------------------------------------- evaluations
def test_validating_a_base_model_into_a_run_folder_leaves_it_free_for_a_fresh_fit(model_dir, tmp_path, capsys):
    """``validate`` of a model folder logs under evaluations/, beside any run: a fresh fit there then starts
    (it was refused: "already holds a run (lightning_logs): resume it with --ckpt_path last", with nothing to
    resume). A folder refused for other outputs advises resuming only when it has checkpoints."""
    run = ["--config", TINY, f"--trainer.default_root_dir={tmp_path}", f"--model.model={model_dir}",
           "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]  # fmt: skip
    main(["validate", *run])
    main([*run, "--trainer.max_steps=1", "--trainer.val_check_interval=1000"])  # refused before
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    logs = sorted(p.parent.parent.name for p in tmp_path.glob("*/version_*/metrics.csv"))
    assert logs == ["evaluations", "lightning_logs"]
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    line = refusal(tmp_path, model_dir, capsys, f"--trainer.default_root_dir={other}", "--trainer.max_steps=1")
    assert "already holds a run (metrics.jsonl)" in line and "--ckpt_path last" not in line
