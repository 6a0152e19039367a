"""Every task builds from a LightningCLI-style config (class_path / init_args), nested rewards included."""

import pytest
from jsonargparse import ArgumentParser

from tasks import DeepMath, Task

F = "tests/fixtures/"
CONFIGS = [
    {"class_path": "tasks.SyntheticTask", "init_args": {"kind": "add", "levels": [1, 2], "num_train": 8}},
    {
        "class_path": "tasks.SyntheticTask",
        "init_args": {"reward": {"class_path": "tasks.EditSimilarity", "init_args": {"metric": "indel"}}},
    },
    {
        "class_path": "tasks.DeepMath",
        "init_args": {
            "path": F + "deepmath.jsonl",
            "validation_size": 1,
            "reward": {"class_path": "tasks.MathVerifyReward", "init_args": {"scale": "pm1", "timeout": 5.0}},
        },
    },
    {"class_path": "tasks.GSM8K", "init_args": {"path": F + "gsm8k.jsonl", "test_size": 1}},
    {
        "class_path": "tasks.PoetryClassification",
        "init_args": {
            "path": F + "poetry.csv",
            "reward": {
                "class_path": "tasks.WeightedSum",
                "init_args": {
                    "rewards": [
                        {"class_path": "tasks.ChrF", "init_args": {"normalize": True}},
                        {"class_path": "tasks.ExactMatch", "init_args": {"normalize": True}},
                    ],
                    "weights": [0.5, 0.5],
                },
            },
        },
    },
    {"class_path": "tasks.PoetryWriting", "init_args": {"path": F + "poetry.jsonl", "test_size": 0.4}},
    {"class_path": "tasks.MeetingBank", "init_args": {"path": F + "meetingbank.jsonl", "test_size": 2}},
    {
        "class_path": "tasks.ReferenceText",
        "init_args": {"path": F + "poetry.jsonl", "prompt_field": "poem name", "reference_field": "author"},
    },
]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    return parser


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["class_path"])
def test_config_instantiates_a_working_task(config):
    parser = _parser()
    task = parser.instantiate(parser.parse_object({"task": config})).task
    assert isinstance(task, Task)
    example = task.examples("train")[0]
    answer = "\\boxed{" + example.answer + "}" if isinstance(task, DeepMath) else example.answer
    rewards = task.reward([example], [answer])
    assert rewards.shape == (1,) and rewards.item() == 1.0
    assert task.successes([example], [answer]).tolist() == [True]


def test_settings_passed_on_to_the_base_classes_are_config_keys():
    # MeetingBank passes seed and chat on to ReferenceTextTask, max_train_examples on to Task (**settings)
    config = {"path": F + "meetingbank.jsonl", "seed": 3, "chat": False, "max_train_examples": 2}
    parser = _parser()
    task = parser.instantiate(
        parser.parse_object({"task": {"class_path": "tasks.MeetingBank", "init_args": config}})
    ).task
    assert (task.seed, task.chat, len(task.examples("train"))) == (3, False, 2)
    assert isinstance(task.examples("train")[0].prompt, str)  # chat=False: raw text


@pytest.mark.parametrize(("task", "key"), [("SyntheticTask", "num_trian"), ("MeetingBank", "max_train_exampls")])
def test_a_misspelt_key_fails_at_parse_time(task, key):
    config = {"class_path": f"tasks.{task}", "init_args": {key: 8}}
    with pytest.raises(Exception, match=key):
        _parser().parse_object({"task": config})
