"""The run's own metrics file: the report's curves whatever the logger, each step once across resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgrpo.eval.metrics_file import METRICS_FILE, MetricsFile, merge_records, read_metrics_file
from sgrpo.eval.report import read_metrics, read_run_metrics
from sgrpo.fit import main

REPO = Path(__file__).resolve().parents[1]


def fit(root: Path, *extra: str):
    return main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", *extra,
    ])  # fmt: skip


def test_a_resume_supersedes_the_steps_it_logs_again_and_a_cut_line_is_skipped(tmp_path):
    metrics = MetricsFile(tmp_path)
    for step in range(4):
        metrics.log_metrics({"train/reward": float(step), "epoch": 0.0}, step)
    metrics.log_metrics({"val/accuracy": 0.5}, 1)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 4, "train/rew')  # a kill mid-write
    resumed = MetricsFile(tmp_path)  # the resumed process, from a checkpoint at step 2
    resumed.mark_resume()
    resumed.log_metrics({"train/reward": 20.0}, 2)
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert lines[-3] == '{"step": 4, "train/rew' and json.loads(lines[-2]) == {"resumed_at": 2}  # kept whole
    series = read_metrics_file(tmp_path / METRICS_FILE)
    assert series == {"train/reward": [(0, 0.0), (1, 1.0), (2, 20.0)], "val/accuracy": [(1, 0.5)]}  # no step 3
    assert merge_records([{"step": 0, "a": 1.0}, {"step": 0, "a": 2.0}]) == {"a": [(0, 2.0)]}  # later wins


def test_a_resume_keeps_the_validation_of_the_checkpoint_it_starts_from(tmp_path):
    """``--validate_last`` scored the final weights at step 3; a resume that extends the run from that checkpoint
    logs training from step 3 again and dropped that validation, which no start runs again."""
    merged = merge_records([{"step": 2, "train/reward": 1.0}, {"step": 3, "val/accuracy": 0.5},
                            {"step": 4, "val/accuracy": 0.7}, {"resumed_at": 3}, {"step": 3, "train/reward": 2.0}])
    assert merged == {"train/reward": [(2, 1.0), (3, 2.0)], "val/accuracy": [(3, 0.5)]}  # step 4's was later
    assert merge_records([{"step": 3, "val/accuracy": 0.5}, {"resumed_at": 3},
                          {"step": 3, "val/accuracy": 0.6}]) == {"val/accuracy": [(3, 0.6)]}  # one owed, run again
    root = tmp_path / "run"
    common = ("--trainer.val_check_interval=100", "--validate_last=true", "--trainer.limit_val_batches=1")
    fit(root, "--trainer.max_steps=3", *common)
    fit(root, "--trainer.max_steps=5", "--ckpt_path=last", *common)
    assert [step for step, _ in read_run_metrics(root)["val/accuracy"]] == [3, 5]


def test_damaged_lines_are_skipped_and_counted_and_the_curves_still_drawn(tmp_path, caplog):
    """A line that is not UTF-8, a JSON list or a string value made a finished run exit 1 with a traceback
    (UnicodeDecodeError, AttributeError, ValueError) and no curves.png."""
    from sgrpo.eval.report import plot_curves

    path = tmp_path / METRICS_FILE
    good = [{"step": 0, "train/reward": 0.5}, {"step": 1, "train/reward": 0.75, "train/grad_norm": float("nan")}]
    damaged = [b"\xff\xfe{\"step\": 2}", b"[1, 2]", b'{"step": 2, "train/reward": "high"}', b'{"step": "two"}']
    path.write_bytes(b"\n".join([json.dumps(good[0]).encode(), *damaged, json.dumps(good[1]).encode()]) + b"\n")
    series = read_run_metrics(tmp_path)
    assert series["train/reward"] == [(0, 0.5), (1, 0.75)]
    assert len(series["train/grad_norm"]) == 1  # NaN is a diverged value, not damage: kept
    assert "skipped 4 damaged lines (line 2 first)" in caplog.text
    assert plot_curves(series, tmp_path / "curves.png").stat().st_size > 0


def spy_on(logger_class: str, monkeypatch) -> list[int]:
    """The steps at which the chosen logger's ``log_metrics`` received a training reward."""
    import lightning.pytorch.loggers as loggers

    cls, steps = getattr(loggers, logger_class), []
    original = cls.log_metrics

    def log_metrics(self, metrics, step=None):
        if "train/reward" in metrics:
            steps.append(step)
        return original(self, metrics, step)

    monkeypatch.setattr(cls, "log_metrics", log_metrics)
    return steps


@pytest.mark.parametrize("logger", ["default", "false", "TensorBoardLogger", "WandbLogger"])
def test_the_report_draws_its_curves_whatever_the_logger(logger, tmp_path, monkeypatch):
    """Lightning's default logger is TensorBoard when tensorboard is installed, and then the report, which read
    metrics.csv, drew no curves. Every logger choice now gives the same metrics file, report and curves, and
    the chosen logger still gets every step."""
    extra, steps = [], None
    if logger == "false":
        extra = ["--trainer.logger=false"]
    elif logger != "default":
        pytest.importorskip({"TensorBoardLogger": "tensorboard", "WandbLogger": "wandb"}[logger])
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.chdir(tmp_path)  # anything a logger writes beside its save_dir stays in the test's folder
        steps = spy_on(logger, monkeypatch)
        extra = [f"--trainer.logger={logger}", f"--trainer.logger.save_dir={tmp_path}"]
    import sgrpo.eval.report as report_module

    titles, plot = [], report_module.plot_curves
    drawn = lambda *a, title="": titles.append(title) or plot(*a, title=title)  # noqa: E731
    monkeypatch.setattr(report_module, "plot_curves", drawn)
    fit(tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=2", "--validate_before=true",
        "--report=true", *extra)  # fmt: skip
    if logger == "WandbLogger":
        import wandb

        wandb.finish()
    series = read_metrics_file(tmp_path / METRICS_FILE)
    assert [s for s, _ in series["train/reward"]] == [0, 1, 2]
    assert [s for s, _ in series["val/accuracy"]] == [0, 2]  # before training, and after 2 steps (logged at 1 once)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "| mean over levels |" in report
    # which run, estimator, temperature and LoRA the report belongs to (it did not say); the figure's title too
    header = report.splitlines()[0]
    assert header.startswith(f"run {tmp_path} (3 steps): SoftmaxGRPO(") and "temperature=0.5" in header
    assert header.endswith("sampling temperature 1, full weights") and "on SyntheticTask" in header
    assert titles == [report.splitlines()[0]]
    if logger == "default":  # the CSV logger's file holds the same values
        assert read_metrics(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") == series
    if steps is not None:
        assert steps == [0, 1, 2]
    if logger == "TensorBoardLogger":
        assert list(tmp_path.glob("lightning_logs/version_0/events.out.tfevents.*"))
    if logger == "WandbLogger":
        assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_a_resume_from_an_older_checkpoint_counts_each_step_once(tmp_path):
    """A run killed after step 5 whose newest checkpoint that loads is at step 4 resumes there: its steps 4 and 5
    are logged again by the resumed run, and when that run ends at step 5 (max_steps 5) the first start's
    step 5 must not stay in the curves."""
    fit(tmp_path, "--trainer.max_steps=6", "--checkpoint_every=2", "--keep_last=null",
        "--trainer.val_check_interval=100")  # fmt: skip
    first = dict(read_run_metrics(tmp_path)["train/reward"])
    for name in ("last.ckpt", "step6.ckpt"):  # lost with the kill
        (tmp_path / "checkpoints" / name).unlink()
    fit(tmp_path, "--trainer.max_steps=5", "--trainer.val_check_interval=100", "--ckpt_path=last")
    resumed = read_run_metrics(tmp_path)["train/reward"]
    assert [s for s, _ in resumed] == [0, 1, 2, 3, 4]
    for step, value in resumed:  # the resumed run reproduces the first start's steps
        assert value == pytest.approx(first[step], rel=1e-5, abs=1e-7), step
    records = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r for r in records if "resumed_at" in r] == [{"resumed_at": 4}]


def test_validations_log_at_the_steps_they_scored_and_checkpoints_keep_their_names(tmp_path):
    """A validation logs at the training steps of the weights it scored (inside a fit Lightning's step is one less);
    set through a logged "step" metric, that value stayed in callback_metrics and named the periodic checkpoints
    after it: step3.ckpt was written as step2.ckpt."""
    fit(tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=1", "--checkpoint_every=1", "--keep_last=5",
        "--validate_before=true")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step*.ckpt")) == [f"step{i}.ckpt" for i in (1, 2, 3)]
    assert [step for step, _ in read_run_metrics(tmp_path)["val/accuracy"]] == [0, 1, 2, 3]
    csv = read_metrics(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert [step for step, _ in csv["val/accuracy"]] == [0, 1, 2, 3] and "step" not in csv
