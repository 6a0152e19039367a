"""Reward functions as plain callables (TRL style): arguments, weights, named parts, failures, configs, logs."""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from sgrpo.types import Example
from tasks import ExactMatch, FunctionReward, SyntheticTask, Task, WeightedSum

CALLS: list[dict] = []


def brevity(prompts, completions, answer, **columns):
    """1 for a completion no longer than the answer, else 0.5 (a function of this module: importable)."""
    return [1.0 if len(c) <= len(a) else 0.5 for c, a in zip(completions, answer, strict=True)]


def recorded(**kwargs):
    CALLS.append(kwargs)
    return [0.0] * len(kwargs["completions"])


def broken(prompts, completions, **columns):
    raise RuntimeError("the judge is down")


def mixed(completions, **columns):  # a value per completion: a number, None (not applicable), junk, NaN
    return [1, None, "0.5", math.nan, True][: len(completions)]


def hangs(completions, **columns):
    time.sleep(60)


def wrong_length(completions, **columns):
    return [1.0]


def exits(completions, **columns):
    sys.exit(3)


def dies(completions, **columns):
    os._exit(7)  # a crash, the OOM killer: the worker ends without a word


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "21?"}]
EXAMPLES = [
    Example("s:21=", "12", 2, {"task": "sort"}),
    Example(CHAT, "12", None, {"source": "x.jsonl", "task": "sort"}),
]


def test_the_function_gets_prompts_completions_and_every_column_as_lists():
    CALLS.clear()
    FunctionReward(recorded).score(EXAMPLES, ["12", "21"])
    (kwargs,) = CALLS
    assert kwargs == {
        "prompts": ["s:21=", CHAT],
        "completions": ["12", [{"role": "assistant", "content": "21"}]],  # "auto": as TRL, messages after chat
        "answer": ["12", "12"],
        "difficulty": [2, None],
        "task": ["sort", "sort"],
        "source": [None, "x.jsonl"],  # a column the first example lacks
    }
    FunctionReward(recorded, completion_format="text").score(EXAMPLES, ["12", "21"])
    FunctionReward(recorded, completion_format="messages").score(EXAMPLES, ["12", "21"])
    assert CALLS[1]["completions"] == ["12", "21"]
    assert CALLS[2]["completions"][0] == [{"role": "assistant", "content": "12"}]


def test_weighted_functions_keep_their_names_as_parts():
    reward = WeightedSum([ExactMatch(), FunctionReward(brevity)], weights=[1.0, 0.2])
    result = reward.score([Example("s:21=", "12")] * 2, ["12", "12 or 21"])
    torch.testing.assert_close(result.total, torch.tensor([1.2, 0.1]))
    assert result.parts["brevity"].tolist() == [1.0, 0.5] and result.parts["exact_match"].tolist() == [1.0, 0.0]
    assert FunctionReward(brevity, name="short").score(EXAMPLES[:1], ["1"]).parts["short"].tolist() == [1.0]


def test_a_function_that_raises_or_miscounts_scores_zero_and_is_counted():
    for function in (broken, wrong_length):
        result = FunctionReward(function).score(EXAMPLES, ["12", "21"])
        assert result.total.tolist() == [0.0, 0.0] and result.failures == 2 and result.counts == {"error": 2}


def test_values_that_are_not_numbers_score_zero_and_none_is_not_applicable():
    examples = [Example("s:21=", "12")] * 5
    result = FunctionReward(mixed).score(examples, ["a"] * 5)
    assert result.total.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.failures == 2 and result.counts == {"none": 1, "error": 2}  # "0.5" and NaN


def test_a_function_that_hangs_in_a_worker_scores_zero_and_is_counted():
    start = time.perf_counter()
    result = FunctionReward(hangs, workers=1, timeout=0.5).score(EXAMPLES, ["12", "21"])
    assert time.perf_counter() - start < 10
    assert result.total.tolist() == [0.0, 0.0] and result.failures == 2 and result.counts == {"timeout": 2}
    assert FunctionReward(brevity, workers=1).score(EXAMPLES[:1], ["12"]).total.tolist() == [1.0]  # pool recovered
    with pytest.raises(ValueError, match="cannot go to a worker process"):
        FunctionReward(lambda completions, **kw: [0.0] * len(completions), workers=1)


def test_sys_exit_in_a_reward_is_a_failed_scoring_not_the_end_of_the_run(caplog):
    """sys.exit(3) in a function (workers 0) ended the run with exit 3, blamed on the update; in a worker
    (workers 1) it killed the worker and the call waited out its whole timeout."""
    for workers in (0, 1):
        caplog.clear()
        start = time.perf_counter()
        result = FunctionReward(exits, workers=workers, timeout=30.0).score(EXAMPLES, ["12", "21"])
        assert time.perf_counter() - start < 5
        assert result.total.tolist() == [0.0, 0.0] and result.failures == 2 and result.counts == {"error": 2}
        assert "sys.exit(3)" in caplog.text and "'exits'" in caplog.text  # named, with the reward


def test_a_worker_that_dies_is_named_dead_at_once_and_replaced(caplog):
    """A worker ended by os._exit (a crash, the OOM killer) was reported as a 60 s timeout after 60 s."""
    start = time.perf_counter()
    result = FunctionReward(dies, workers=1, timeout=30.0).score(EXAMPLES, ["12", "21"])
    assert time.perf_counter() - start < 5
    assert result.total.tolist() == [0.0, 0.0] and result.failures == 2 and result.counts == {"error": 2}
    assert "worker process died (exit code 7)" in caplog.text
    assert FunctionReward(brevity, workers=1).score(EXAMPLES[:1], ["12"]).total.tolist() == [1.0]  # replaced


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    return parser


def test_a_config_names_functions_by_import_path():
    rewards = [
        {"class_path": "tasks.FunctionReward", "init_args": {"function": "tests.test_tasks_functions.brevity"}},
        {"class_path": "tasks.FunctionReward", "init_args": {"function": "tests.test_tasks_functions.broken"}},
    ]
    reward = {"class_path": "tasks.WeightedSum", "init_args": {"rewards": rewards, "weights": [1.0, 0.5]}}
    config = {"class_path": "tasks.SyntheticTask", "init_args": {"num_train": 4, "reward": reward}}
    parser = _parser()
    task = parser.instantiate(parser.parse_object({"task": config})).task
    assert [r.function for r in task.reward.rewards] == [brevity, broken]
    misspelt = {"class_path": "tasks.FunctionReward", "init_args": {"function": "tests.test_tasks_functions.brevty"}}
    with pytest.raises(Exception, match="brevty"):  # at parse time, before anything loads
        parser.parse_object({"task": config | {"init_args": {"reward": misspelt}}})


def test_a_fit_logs_each_function_and_counts_its_failures(tmp_path):
    from estimators import GRPO
    from sgrpo.model.tiny import ensure_tiny_model
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from tests.engine_helpers import run_steps

    reward = WeightedSum([FunctionReward(brevity), FunctionReward(broken)])
    task = SyntheticTask(levels=[3], num_train=8, reward=reward)
    model = ensure_tiny_model(tmp_path / "tiny")
    policy = GRPOPolicy(str(model), task, GRPO(), HFRollout(max_new_tokens=4), group_size=2, prompts_per_step=2)
    trainer = run_steps(policy, steps=1, root=str(tmp_path / "run"))
    logged = trainer.callback_metrics
    assert {"train/reward/brevity", "train/reward/broken"} <= set(logged)
    assert logged["train/reward/broken"].item() == 0.0 and logged["train/reward/failures"].item() == 4.0


def test_the_docs_config_parses_and_grades_math_once():
    page = (Path(__file__).parents[1] / "docs" / "tasks.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.S) if "tasks.FunctionReward" in b)
    block = block.replace("mymodule.format_reward", "tests.test_tasks_functions.brevity")
    config = yaml.safe_load(block)["model"]["task"]
    config["init_args"]["path"] = "tests/fixtures/deepmath.jsonl"  # offline
    parser = _parser()
    task = parser.instantiate(parser.parse_object({"task": config})).task
    math_verify, function = task.reward.rewards
    assert function.function is brevity and function.workers == 1
    assert math_verify.grades_like(task.success_grader)  # success comes from the reward's own grading
