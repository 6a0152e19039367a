"""Evaluation without training (``sgrpo.fit validate|test``) of checkpoints and model folders.

Export: tests/test_export.py; sharded (FSDP2) checkpoints are exported in tests/test_sharded.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgrpo.eval.evaluation import evaluation_table
from sgrpo.eval.metrics_file import METRICS_FILE
from sgrpo.eval.report import read_metrics
from sgrpo.fit import main
from sgrpo.run.folders import lock_run, unlock_run

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "sgrpo" / "assets" / "quickstart_model"
IDS = torch.tensor([[16, 15, 6, 4, 7, 14, 5, 6, 7, 2]])  # "s:314=" and a completion
LORA = ["--model.peft.rank=4", "--model.peft.alpha=8", "--model.optimizer.init_args.lr=0.01"]


def args(root: Path, *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.task.init_args.num_test=24", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    main(args(root, "--trainer.max_steps=2", "--trainer.val_check_interval=100"))
    return root


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    main(args(root, "--trainer.max_steps=2", "--trainer.val_check_interval=100", "--model.peft.export_merged=true",
              *LORA))  # fmt: skip
    return root


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------ evaluation
def test_validate_of_a_run_that_cannot_be_written_prints_its_table_and_writes_nothing(run, monkeypatch, capsys,
                                                                                       caplog):  # fmt: skip
    """A run on a read-only mount: the evaluation's logger and its config.yaml need the folder, so without them it
    runs (it failed making evaluations/version_N) and says so in one line."""
    import sgrpo.fit

    monkeypatch.setattr(sgrpo.fit, "writable", lambda root: False)  # as on a read-only mount, which tests cannot make
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        main(["validate", *args(run, "--ckpt_path=last")])
    assert "| mean over levels |" in capsys.readouterr().out
    assert any("cannot be written: this validate prints its table" in r.getMessage() for r in caplog.records)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_validate_a_checkpoint_and_its_exported_folder_alike(run, capsys):
    """``validate`` from the run's last checkpoint and from the folder its fit exported: the same policy, the same
    seeded samples, the same accuracy; neither touches the run's checkpoints or metrics file, nor needs its lock."""
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    metrics = (run / METRICS_FILE).read_bytes()
    lock = lock_run(run)  # a fit still running in the folder does not stop an evaluation of its checkpoints
    try:
        checkpoint = main(["validate", *args(run, "--ckpt_path=last")]).model.last_evaluation
    finally:
        unlock_run(lock)
    out = capsys.readouterr().out
    assert f"Validation accuracy by difficulty: {run / 'checkpoints' / 'last.ckpt'} (step 2)" in out
    assert evaluation_table(checkpoint) in out and "| mean over levels |" in out
    folder = main(["validate", *args(run, f"--model.model={run / 'hf_model'}")]).model.last_evaluation
    assert checkpoint["split"] == folder["split"] == "validation" and checkpoint["prompts"] == 16
    for key in ("accuracy", "by_difficulty", "pass_at_k"):
        assert folder[key] == checkpoint[key], key
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before
    assert (run / METRICS_FILE).read_bytes() == metrics


def test_test_evaluates_the_test_split_and_logs_test_metrics(run, capsys):
    cli = main(["test", *args(run, f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}")])
    result = cli.model.last_evaluation
    assert result["split"] == "test" and result["prompts"] == 24  # num_test, not the 16 validation prompts
    assert "Test accuracy by difficulty" in capsys.readouterr().out
    logged = read_metrics(Path(cli.trainer.logger.log_dir) / "metrics.csv")
    step = cli.model.rollout_step  # the checkpoint's training steps (every evaluation was logged at 0)
    assert step > 0 and logged["test/accuracy"] == [(step, pytest.approx(result["accuracy"]))]
    for level, accuracy in result["by_difficulty"].items():
        assert logged[f"test/accuracy/{level}"] == [(step, pytest.approx(accuracy))]
    assert logged["test/pass@2"] == [(step, pytest.approx(result["pass_at_k"][2]))]
    assert not any(key.startswith("val/") for key in logged)


def lora_record(run: Path, tmp_path: Path) -> str:
    """The full run's checkpoint, saying it was trained with LoRA."""
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    checkpoint["sgrpo"]["policy"]["peft"] = {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                            "target_modules": "all-linear", "export_merged": False}  # fmt: skip
    torch.save(checkpoint, tmp_path / "lora.ckpt")
    return str(tmp_path / "lora.ckpt")


def other_shapes(run: Path, tmp_path: Path) -> str:
    """The full run's checkpoint with an embedding one row longer: a model of other shapes than model.model."""
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    key = next(k for k in checkpoint["state_dict"] if k.endswith("embed_tokens.weight"))
    weight = checkpoint["state_dict"][key]
    checkpoint["state_dict"][key] = torch.cat([weight, weight[:1]])
    torch.save(checkpoint, tmp_path / "other.ckpt")
    return str(tmp_path / "other.ckpt")


@pytest.mark.parametrize("case", ["missing", "no_last", "truncated", "lora_without_peft", "other_shapes"])
def test_evaluation_refuses_a_bad_checkpoint_in_one_line(case, run, tmp_path, capsys):
    if case == "truncated":
        (tmp_path / "cut.ckpt").write_bytes((run / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    ckpt = {"missing": str(tmp_path / "nothing.ckpt"), "no_last": "last", "truncated": str(tmp_path / "cut.ckpt"),
            "lora_without_peft": lora_record(run, tmp_path) if case == "lora_without_peft" else "",
            "other_shapes": other_shapes(run, tmp_path) if case == "other_shapes" else ""}[case]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        main(["validate", *args(tmp_path / "eval", f"--ckpt_path={ckpt}")])
    assert refused.value.code == 2
    line = error_line(capsys)
    assert {"missing": "no such checkpoint", "no_last": "--ckpt_path last:", "truncated": "does not load",
            "lora_without_peft": "trained with LoRA adapters",
            "other_shapes": "does not load into model.model"}[case] in line  # fmt: skip
    if case == "other_shapes":  # the first mismatch is named, not only Lightning's heading
        assert "size mismatch for model.model.embed_tokens.weight" in line, line


def test_an_error_after_the_checkpoint_loaded_keeps_its_traceback(run, tmp_path, monkeypatch):
    """Lightning's connector holds the checkpoint until resume_end, past the model's move to its device: an
    out-of-memory there was refused as "does not load into model.model", exit 2, its traceback dropped."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    def model_to_device(self):
        raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

    monkeypatch.setattr(SingleDeviceStrategy, "model_to_device", model_to_device)
    with pytest.raises(torch.OutOfMemoryError, match="the test's"):
        main(["validate", *args(tmp_path / "eval", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}")])


def test_on_several_processes_a_checkpoint_that_does_not_fit_ends_them_with_its_one_line(monkeypatch):
    """Several processes: ``FailFast`` ends every process with the refusal's line and exit status 2 when the error
    arose while the checkpoint loaded; any later error keeps the traceback path (line None, its own status)."""
    import sgrpo.run.faults as faults

    ended = []
    monkeypatch.setattr(faults, "fail_fast", lambda trainer, err, line=None, status=None: ended.append((line, status)))
    connector = SimpleNamespace(_loaded_checkpoint={"state_dict": {}})  # Lightning's, from resume_start to resume_end
    trainer = SimpleNamespace(world_size=2, ckpt_path="a.ckpt", _checkpoint_connector=connector)

    def restore_model():  # raised where Lightning's connector loads the weights
        raise RuntimeError("Error(s) in loading state_dict for GRPOPolicy:\n\tsize mismatch for w: 3 against 2.")

    def model_to_device():  # the connector still holds the checkpoint while the strategy moves the model
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(RuntimeError) as loading:
        restore_model()
    with pytest.raises(torch.OutOfMemoryError) as after_load:
        model_to_device()
    err, moving = loading.value, after_load.value
    watch = faults.FailFast()
    watch.on_exception(trainer, None, err)
    assert watch.failed_load is err
    assert ended == [("error: --ckpt_path a.ckpt does not load into model.model (RuntimeError: Error(s) in loading "
                      "state_dict for GRPOPolicy: size mismatch for w: 3 against 2.): evaluate it with the config that "
                      "trained it (model.model, model.peft), or export it (python -m sgrpo.export CKPT OUT) and "
                      "evaluate OUT with --model.model=OUT", 2)]  # fmt: skip
    later = faults.FailFast()  # between the load and resume_end: not the checkpoint's (the traceback is kept)
    later.on_exception(trainer, None, moving)
    assert later.failed_load is None and ended[-1] == (None, None)
    connector._loaded_checkpoint = {}  # loaded: a later error is not the checkpoint's
    after = faults.FailFast()
    after.on_exception(trainer, None, err)
    assert after.failed_load is None and ended[-1] == (None, None)


# ------------------------------------------------------------------------------------------ export
def test_validate_a_lora_checkpoint_as_its_merged_export(lora_run):
    """A LoRA checkpoint holds only the adapters: evaluated with the run's config (its peft block) on the base
    model folder, it scores as the merged model its fit exported."""
    adapters = main(["validate", *args(lora_run, "--ckpt_path=last", *LORA)]).model.last_evaluation
    merged = main(["validate", *args(lora_run, f"--model.model={lora_run / 'hf_model' / 'merged'}")])
    for key in ("accuracy", "by_difficulty", "pass_at_k"):
        assert merged.model.last_evaluation[key] == adapters[key], key


def test_a_checkpoint_is_evaluated_on_the_base_it_trained_from(run, lora_run, tmp_path, capsys, caplog):
    """``validate --ckpt_path`` with another ``model.model`` of the same shapes scored LoRA adapters on that model,
    exit 0 (a review: pass@1 31.2 % on the base, 15.6 % on another). A copy of the base elsewhere is the same model;
    another base is refused under LoRA and named in a warning for full weights (they load over it)."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(SHIPPED, copy)
    main(["validate", *args(tmp_path / "same", "--ckpt_path", str(lora_run / "checkpoints" / "last.ckpt"),
                            f"--model.model={copy}", *LORA[:2])])  # fmt: skip
    weights = load_file(copy / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, copy / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["validate", *args(tmp_path / "lora", "--ckpt_path", str(lora_run / "checkpoints" / "last.ckpt"),
                                f"--model.model={copy}", *LORA[:2])])  # fmt: skip
    line = error_line(capsys)
    assert refused.value.code == 2 and "holds LoRA adapters trained on another base model than model.model" in line
    assert "model.model@content: " in line
    with caplog.at_level("WARNING", logger="sgrpo.evaluate"):
        main(["validate", *args(tmp_path / "full", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
                                f"--model.model={copy}")])  # fmt: skip
    assert "was trained from another base model than model.model (model.model@content: " in caplog.text
