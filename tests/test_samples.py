"""Sample completions in the logs: completions.jsonl in the run folder, and the TensorBoard / W&B loggers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from estimators import SoftmaxGRPO
from sgrpo.eval.completions import markdown_table, write_rows
from sgrpo.fit import main

REPO = Path(__file__).resolve().parents[1]


def test_a_fit_writes_a_few_groups_per_step_to_completions_jsonl(tmp_path):
    main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2", "--trainer.val_check_interval=100", "--trainer.enable_progress_bar=false",
        "--model.log_completions_every=1", "--model.log_completions_groups=1",
    ])  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4  # 1 group of G = 4 per step
    assert set(rows[0]) == {"step", "group", "prompt", "completion", "reward", "success", "advantage",
                            "reward/exact_match"}  # fmt: skip
    for step in (0, 1):
        group = [r for r in rows if r["step"] == step]
        assert len({r["prompt"] for r in group}) == 1 and group[0]["prompt"].startswith("s:")
        assert all(r["success"] == (r["reward"] == 1.0) for r in group)  # exact match: reward 1 iff right
        rewards = torch.tensor([[r["reward"] for r in group]])
        want = SoftmaxGRPO(temperature=0.5)(rewards)[0].tolist()  # tiny.yaml's estimator
        assert [r["advantage"] for r in group] == pytest.approx(want, abs=1e-6)


class TensorBoardLogger:  # named like Lightning's: the rows go to experiment.add_text
    def __init__(self) -> None:
        self.texts: list[tuple[str, str, int]] = []
        self.experiment = self

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        self.texts.append((tag, text, global_step))


class WandbLogger:  # named like Lightning's: the rows go to log_table
    def __init__(self) -> None:
        self.tables: list[dict] = []

    def log_table(self, **kwargs) -> None:
        self.tables.append(kwargs)


def test_rows_go_to_tensorboard_text_and_a_wandb_table(tmp_path):
    rows = [{"step": 3, "prompt": "a|b", "completion": "x\ny", "reward": 0.25}]
    tensorboard, wandb = TensorBoardLogger(), WandbLogger()
    write_rows(rows, tmp_path, [tensorboard, wandb], step=3)
    assert tensorboard.texts == [("completions", markdown_table(list(rows[0]), rows), 3)]
    assert "a\\|b" in tensorboard.texts[0][1] and "x<br>y" in tensorboard.texts[0][1]  # cells escaped
    assert wandb.tables == [{"key": "completions", "columns": ["step", "prompt", "completion", "reward"],
                             "data": [[3, "a|b", "x\ny", 0.25]], "step": 3}]  # fmt: skip
    assert json.loads((tmp_path / "completions.jsonl").read_text()) == rows[0]


def test_a_row_cut_short_by_a_kill_leaves_the_next_rows_whole(tmp_path):
    """A kill mid-write left a cut line, and the resumed run's first row was glued onto it (neither parsed); the
    metrics file already ended such a line first, the completions log does too now."""
    (tmp_path / "completions.jsonl").write_text('{"step": 1, "group": 0}\n{"step": 2, "gro')
    write_rows([{"step": 2, "group": 0}, {"step": 2, "group": 1}], tmp_path, [], step=2)
    lines = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 2, "gro'  # the cut line stays, on its own
    assert [json.loads(line) for line in lines[2:]] == [{"step": 2, "group": 0}, {"step": 2, "group": 1}]
