"""benchmarks/tools_quickstart.py: the curves' ends and the summary from runs' figures, its docs render; end to
end at a tiny size (bench)."""

from __future__ import annotations

import json

import pytest

from benchmarks import artefact
from benchmarks import tools_quickstart as bench
from benchmarks.figures.tools import tools_quickstart as render


def _run(seed: int, base: float, trained: float) -> dict:
    by = lambda x: {"success": {"1": x, "4": x / 2}, "tool_use": {"1": x / 4, "4": x}}  # noqa: E731
    return {"seed": seed, "fit_seconds": 60.0 + seed, "base": by(base), "trained": by(trained),
            "train": {"train/reward": [base, trained], "train/episode/tool_use_rate": [0.5, 0.9]}}  # fmt: skip


def test_curve_ends_average_the_first_and_last_steps(tmp_path):
    rows = [{"step": i, "train/reward": float(i), "train/episode/tool_use_rate": i / 10} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [{"step": 0, "val/accuracy": 1}, *rows]))
    ends = bench.curve_ends(tmp_path / "metrics.jsonl", 2)
    assert ends == {"train/reward": [0.5, 4.5], "train/episode/tool_use_rate": [0.05, 0.45]}


def test_summary_means_over_seeds_and_the_render_states_them():
    runs = [_run(0, 0.2, 0.6), _run(1, 0.4, 0.3)]
    s = bench.summary(runs, [1, 4])
    assert s["base_success"] == {"1": 0.3, "4": 0.15, "mean": 0.225}
    assert s["trained_tool_use"] == {"1": 0.1125, "4": 0.45, "mean": 0.2812}
    assert s["train/reward"] == [0.3, 0.45]
    result = {"config": bench.CONFIG, "steps": 5, "levels": [1, 4], "eval_prompts": 3, "samples": 2, "window": 1,
              "runs": runs, "summary": s, "wall_s": 1.0}  # fmt: skip
    stamp = {"command": "cmd", "date": "2026-12-02", "machine": {"cpus": 2, "load_average": [1.0]}, "result": result}
    text = render(stamp)
    flat = " ".join(text.split())
    assert "success over levels rose in 1 of 2 seeds and tool use in 1 of 2" in flat
    assert "| mean over levels | 22.5 % | 33.8 % | +11.3 pts | 18.8 % | 28.1 % | +9.4 pts |" in text
    assert "from 0.300 (mean of the first 1 steps) to 0.450" in flat
    s["base_success"]["1"] = 0.9  # a summary that is not the runs' mean is refused
    with pytest.raises(AssertionError):
        render(stamp)
    assert "| seed | success base -> trained |" in bench.report(result)


@pytest.mark.bench
def test_tiny_run_publishes_base_and_trained(tmp_path):
    bench.main(["--seeds", "0", "--steps", "2", "--eval-prompts", "1", "--samples", "1", "--window", "1",
                "--out", str(tmp_path)])  # fmt: skip
    stamp = json.loads((artefact.REPORTS / "tools_quickstart" / "result.json").read_text())
    (run,) = stamp["result"]["runs"]
    assert set(run["base"]) == set(run["trained"]) == {"success", "tool_use"}
    assert set(run["base"]["success"]) == {"1", "2", "3"} and (tmp_path / "seed0" / "hf_model").is_dir()
    assert (artefact.REPORTS / "tools_quickstart" / "figures.md").read_text().startswith("`.venv/bin/python")
