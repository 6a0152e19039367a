"""The evaluation's torchmetrics metrics (sgrpo.eval.metrics) against hand-computed values, in one process and
synced over two (tests/sharded_worker.py's ``metrics`` job, in test_sharded.py's launch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sgrpo.eval.metrics import SET_METRICS, AccuracyByDifficulty, MeanAccuracy, MeanReward, PassAtK, PromptOutcomes
from tasks.synthetic import SyntheticTask

N = 4
LEVELS = ["easy", "hard"]  # string labels: the states hold their indices
#: prompt index -> (correct samples of N, level index); 7 distinct prompts
PROMPTS = {0: (2, 0), 1: (0, 1), 2: (4, 0), 3: (1, 1), 4: (3, 0), 5: (0, 1), 6: (2, 1)}
#: Lightning's DistributedSampler over 2 processes: 7 prompts padded to 8, prompt 0 repeated on rank 1, whose
#: samples of it differ (4 right): the first copy (rank 0's) counts. Two batches per process.
SHARES = {0: [[0, 2], [4, 6]], 1: [[1, 3], [5, 0]]}
RANK1_COPY = {0: (4, 0)}
#: by hand: accuracy 12 / 28; per prompt 1 - C(4 - c, k) / C(4, k) for c = 0..4 is 0, 1/2, 5/6, 1, 1 at k = 2,
#: 0, 3/4, 1, 1, 1 at k = 3 and 0, 1, 1, 1, 1 at k = 4 (5 of the 7 prompts have a right sample)
HAND = {
    "accuracy": 12 / 28,
    "pass_at_k": [12 / 28, (5 / 6 + 0 + 1 + 1 / 2 + 1 + 0 + 5 / 6) / 7, (1 + 0 + 1 + 3 / 4 + 1 + 0 + 1) / 7, 5 / 7],
    "by_difficulty": [9 / 12, 3 / 16],
    "pass_at_k_by_difficulty": [[9 / 12, (5 / 6 + 1 + 1) / 3], [3 / 16, (0 + 1 / 2 + 0 + 5 / 6) / 4]],
    "successes": [2.0, 1.0, 2.0, 1.0, 1.0],
}


class TwoSets(SyntheticTask):
    """The sort task whose validation split is two evaluation sets of uneven sizes, by level."""

    def evaluation_set(self, example) -> str:
        return "short" if example.difficulty == 3 else "long"


#: ``sgrpo.fit validate`` of TwoSets, greedy: 15 prompts (8 short, 7 long) in batches of 4; over 2 processes the
#: sampler repeats one, and each process holds its own share of each set
REPO = Path(__file__).resolve().parents[1]
TWO_SETS = ["validate", "--config", str(REPO / "configs" / "tiny.yaml"),
            f"--model.model={REPO / 'sgrpo' / 'assets' / 'quickstart_model'}",
            "--model.task=tests.test_eval_metrics.TwoSets", "--model.task.init_args.num_validation=15",
            "--trainer.limit_val_batches=null", "--model.val_prompts_per_batch=4", "--model.val_greedy=true",
            "--model.val_samples=1", "--trainer.enable_progress_bar=false"]  # fmt: skip


def batch(indices: list[int], rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index, correct [B, N], level) of ``indices``; correct samples first in each row."""
    outcomes = [(RANK1_COPY.get(i) if rank == 1 else None) or PROMPTS[i] for i in indices]
    correct = torch.tensor([[s < c for s in range(N)] for c, _ in outcomes])
    return torch.tensor(indices), correct, torch.tensor([level for _, level in outcomes])


def results(metrics: dict[str, PromptOutcomes]) -> dict[str, list | float]:
    return {key: metric.compute().tolist() for key, metric in metrics.items()}


def check_by_hand(got: dict[str, list | float]) -> None:
    assert got["accuracy"] == pytest.approx(HAND["accuracy"], abs=1e-12)
    assert got["pass_at_k"] == pytest.approx(HAND["pass_at_k"], abs=1e-12)
    assert got["by_difficulty"] == pytest.approx(HAND["by_difficulty"], abs=1e-12)
    by_level = [row[:2] for row in got["pass_at_k_by_difficulty"]]
    assert by_level == [pytest.approx(row, abs=1e-12) for row in HAND["pass_at_k_by_difficulty"]]
    assert got["successes"] == HAND["successes"]


def test_pass_at_k_by_hand():
    metric = PassAtK(N, LEVELS)
    metric.update(*batch(list(PROMPTS)))
    assert metric.compute().tolist() == pytest.approx([3 / 7, 25 / 42, 19 / 28, 5 / 7], abs=1e-12)


def test_metrics_by_hand_and_each_prompt_once():
    """Rank 0's and rank 1's batches in one process (as the synced states hold them, in rank order): the
    repeated prompt 0 counts once, as its first copy; the values are the hand-computed ones; float64."""
    metrics = {key: metric(N, LEVELS) for key, metric in SET_METRICS.items()}
    for rank in (0, 1):
        for indices in SHARES[rank]:
            for metric in metrics.values():
                metric.update(*batch(indices, rank))
    check_by_hand(results(metrics))
    assert metrics["accuracy"].compute().dtype == torch.float64
    twice = MeanAccuracy(N, LEVELS)
    twice.update(*batch([0, 1, 2, 3, 4, 5, 6]))
    assert twice.compute().item() == pytest.approx(12 / 28)
    for metric in metrics.values():  # reset: nothing left for the next evaluation
        metric.reset()
        assert metric.rows == []


def test_a_label_without_prompts_is_nan_and_bad_updates_are_refused():
    metric = AccuracyByDifficulty(N, ["3", "5", "7"])
    metric.update(torch.tensor([0]), torch.tensor([[True, True, False, False]]), torch.tensor([1]))
    got = metric.compute().tolist()
    assert math.isnan(got[0]) and got[1] == 0.5 and math.isnan(got[2])
    with pytest.raises(ValueError, match=r"correct \[B, 4\]"):
        metric.update(torch.tensor([0]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([0]))
    with pytest.raises(ValueError, match="level indices must be in"):
        metric.update(torch.tensor([0]), torch.ones(1, 4, dtype=torch.bool), torch.tensor([3]))


def synced_job(out: str) -> None:
    """Run on 2 processes (tests/sharded_worker.py ``metrics``): each updates its own share, rank 1 the repeated
    prompt too; a second set only rank 0 has prompts of. Rank 0 writes what every process computed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    metrics = {key: metric(N, LEVELS) for key, metric in SET_METRICS.items()}
    for indices in SHARES[rank]:
        for metric in metrics.values():
            metric.update(*batch(indices, rank))
    only_rank0 = MeanAccuracy(N, LEVELS)
    if rank == 0:
        only_rank0.update(*batch([2, 3]))  # 5 of 8 samples right
    computed = results(metrics) | {"only_rank0": only_rank0.compute().item()}
    gathered = [None, None]
    dist.all_gather_object(gathered, computed)
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "metrics.json").write_text(json.dumps(gathered))


def check_synced_metrics(out: Path) -> None:
    """Synced over the 2 processes, each process's metrics are the one-process values over the 7 distinct
    prompts (the repeated one once, rank 0's copy), and a set one process holds nothing of syncs too."""
    one = {key: metric(N, LEVELS) for key, metric in SET_METRICS.items()}
    for metric in one.values():
        metric.update(*batch(list(PROMPTS)))
    want = results(one)
    for got in json.loads((out / "metrics.json").read_text()):
        assert got.pop("only_rank0") == 5 / 8
        assert got == want
        check_by_hand(got)


def test_one_table_per_evaluation_set_and_a_single_set_as_before():
    """``evaluation_table`` (what ``sgrpo.fit validate`` prints) and the report's ``accuracy_table``: a titled table
    per set for several; for one set the table as it always was, untitled."""
    from sgrpo.eval.evaluation import evaluation_table, result_sets
    from sgrpo.eval.report import accuracy_table

    one = {"accuracy": 0.5, "by_difficulty": {"3": 0.75, "5": 0.25}, "pass_at_k": {1: 0.5, 2: 0.625}, "prompts": 4}
    single = {"step": 0} | one
    assert evaluation_table(single) == (
        "| difficulty | accuracy |\n|---|---|\n| 3 | 75.0% |\n| 5 | 25.0% |\n| mean over levels | 50.0% |\n\n"
        "pass@1 50.0%, pass@2 62.5% (4 prompts, 2 samples each)"
    )
    two = {"step": 2, "sets": {"aime25": one, "math500": one | {"by_difficulty": {"1": 1.0}, "prompts": 3}}}
    assert list(result_sets(two)) == ["aime25", "math500"] and result_sets(single) == {"": single}
    table = evaluation_table(two)
    assert table.startswith("aime25\n| difficulty | accuracy |") and "\n\nmath500\n| difficulty |" in table
    assert "| 1 | 100.0% |" in table and "(3 prompts, 2 samples each)" in table
    report = accuracy_table([two | {"step": 0}, two])
    assert report.startswith("aime25\n| difficulty | step 0 (base) | step 2 (trained) | change |")
    assert "\n\nmath500\n" in report and "| 1 | 100.0% | 100.0% | +0.0 pts |" in report
    assert accuracy_table([single, single]).startswith("| difficulty | step 0 (base) |")


def test_the_report_calls_only_step_0_the_base_and_averages_the_levels_both_measured():
    """Without --validate_before the first validation is a trained step: it was headed "(base)". A level the last
    validation lacks counted 0 in its mean (a -15 pts change for a level that was not measured; found by a review);
    it shows "-" on the side that lacks it, and a level only the last validation has is shown too."""
    from sgrpo.eval.report import accuracy_table

    first = {"step": 25, "accuracy": 0.5, "by_difficulty": {"3": 0.6, "5": 0.4}, "pass_at_k": {1: 0.5}, "prompts": 4}
    last = first | {"step": 50, "by_difficulty": {"3": 0.7}}
    table = accuracy_table([first, last])
    assert table.startswith("| difficulty | step 25 (first validation) | step 50 (trained) | change |")
    assert "| 5 | 40.0% | - | - |" in table  # it printed "nan%" and "+nan pts"
    assert table.endswith("| mean over levels in both | 60.0% | 70.0% | +10.0 pts |")
    # a level only the last validation measured (other evaluation data on resume) was left out of the table
    table = accuracy_table([first, last | {"by_difficulty": {"3": 0.7, "9": 0.1}}])
    assert "| 9 | - | 10.0% | - |" in table
    assert table.endswith("| mean over levels in both | 60.0% | 70.0% | +10.0 pts |")


def check_two_sets_validate_as_one_process(root: Path, tmp_path: Path) -> None:
    """``sgrpo.fit validate`` of two evaluation sets over 2 FSDP2 processes (test_sharded's launch): greedy, so
    the result is the one-process result, each set's prompts counted once (8 and 7: the sampler's repeat once)."""
    from sgrpo.fit import main

    two = json.loads((root / "validation.json").read_text())
    one = main([*TWO_SETS, f"--trainer.default_root_dir={tmp_path / 'one_process'}"]).model.last_evaluation
    assert json.loads(json.dumps(one)) == two  # the JSON round trip turns the k of pass@k into strings
    assert list(two["sets"]) == ["short", "long"] and [s["prompts"] for s in two["sets"].values()] == [8, 7]


def test_mean_reward_counts_each_prompt_once_by_hand():
    """val/reward (OpenThoughts: verl's validation score): prompts 0 and 1 with 2 samples each, rewards
    [0.2, 0.4] and [1.0, 0.6]; prompt 1 seen again (a repeat of Lightning's sampler) counts once: (0.6 + 1.6) / 4."""
    metric = MeanReward(samples=2)
    metric.update(torch.tensor([0, 1]), torch.tensor([[0.2, 0.4], [1.0, 0.6]]))
    metric.update(torch.tensor([1]), torch.tensor([[0.0, 0.0]]))  # the repeat: its first copy stands
    assert metric.compute().item() == pytest.approx(2.2 / 4)
    with pytest.raises(ValueError, match="rewards \\[B, 2\\]"):
        metric.update(torch.tensor([2]), torch.tensor([[0.5]]))


def test_greedy_validation_decodes_one_completion_per_prompt(tmp_path):
    """``val_greedy`` with ``val_samples`` 4 (its default) decoded 4 identical argmax copies of each prompt and
    logged pass@1..4, all equal: 4x the compute, and pass@k that mean nothing."""
    from sgrpo.fit import main

    greedy = [arg for arg in TWO_SETS if arg != "--model.val_samples=1"] + ["--model.val_samples=4"]
    cli = main([*greedy, f"--trainer.default_root_dir={tmp_path}"])
    assert cli.model.val_samples == 1
    assert all(list(s["pass_at_k"]) == [1] for s in cli.model.last_evaluation["sets"].values())


def test_the_report_asks_for_the_validation_it_lacks():
    from sgrpo.eval.report import accuracy_table

    assert accuracy_table([]).endswith("set --validate_before true)")
    assert accuracy_table([{"step": 0}]).endswith("set --validate_last true)")  # the base point is there already
    assert accuracy_table([{"step": 4}]).endswith("set --validate_before true)")


@pytest.mark.slow  # a fresh interpreter imports torch and Lightning: ~10 s
def test_python_m_sgrpo_evaluate_says_which_command_evaluates():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "sgrpo.evaluate"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and "python -m sgrpo.fit validate" in done.stderr  # it did nothing, exit 0
