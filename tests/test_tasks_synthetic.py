"""Synthetic digit tasks: deterministic generation, correct answers, exact and similarity rewards."""

import random

import pytest

from sgrpo.types import Example
from tasks import EditSimilarity, SyntheticTask
from tasks.synthetic import VOCABULARY, make_example


def _check_answer(example: Example) -> None:
    prompt, answer = example.prompt, example.answer
    if prompt.startswith("s:"):
        assert answer == "".join(sorted(prompt[2:-1]))
    elif "+" in prompt:
        a, b = prompt[:-1].split("+")
        assert answer == str(int(a) + int(b))[::-1]
    else:
        assert answer == str(sum(map(int, prompt[:-1])) % 10)


@pytest.mark.parametrize("kind", ["sort", "add", "dsum"])
def test_generation_is_deterministic_correct_and_in_vocabulary(kind):
    task = SyntheticTask(kind=kind, num_train=60, num_validation=30, num_test=30, seed=3)
    again = SyntheticTask(kind=kind, num_train=60, num_validation=30, num_test=30, seed=3)
    for split in ("train", "validation", "test"):
        assert task.examples(split) == again.examples(split)
    assert task.examples("train") != SyntheticTask(kind=kind, num_train=60, seed=4).examples("train")
    assert task.examples("train")[:10] != task.examples("validation")[:10]
    levels = task.levels
    for i, example in enumerate(task.examples("train")):
        _check_answer(example)
        assert example.difficulty == levels[i % len(levels)]  # balanced, interleaved levels
        assert isinstance(example.prompt, str) and set(example.prompt + example.answer) <= set(VOCABULARY)


def test_levels_set_the_sizes():
    rng = random.Random(0)
    sort7 = make_example("sort", 7, rng)
    assert len(sort7.prompt) == len("s:") + 7 + 1 and len(sort7.answer) == 7
    add3 = make_example("add", 3, rng)
    a, b = add3.prompt[:-1].split("+")
    assert len(a) == len(b) == 3 and add3.metadata["answer_plain"] == str(int(a) + int(b))
    dsum4 = make_example("dsum", 4, rng)
    assert len(dsum4.prompt) == 5 and len(dsum4.answer) == 1


def test_spec_fixture_rows_grade_correct():
    rows = [("7+5=", "21"), ("408+793=", "1021"), ("9274=", "2"), ("s:50381=", "01358"), ("s:91=", "19")]
    for prompt, answer in rows:
        _check_answer(Example(prompt, answer))


def test_exact_reward_and_success():
    task = SyntheticTask(num_train=3)
    ex = Example("s:3142=", "1234", 4)
    completions = ["1234", " 1234\n", "1243", "", "12345"]
    assert task.reward([ex] * 5, completions).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert task.successes([ex] * 5, completions).tolist() == [True, True, False, False, False]


def test_similarity_reward_is_continuous_and_success_stays_exact():
    task = SyntheticTask(reward=EditSimilarity(), num_train=3)
    ex = Example("s:3142=", "1234", 4)
    rewards = task.reward([ex] * 4, ["1234", "1243", "12", "9999"]).tolist()
    # Levenshtein: "1243" -> 2 substitutions of 4 -> 0.5; "12" -> 2 insertions -> 0.5; "9999" -> 0
    assert rewards == [1.0, 0.5, 0.5, 0.0]
    assert task.successes([ex] * 2, ["1243", "1234"]).tolist() == [False, True]
    indel = EditSimilarity(metric="indel")
    # Indel (insertions/deletions only): "1243" vs "1234": distance 2 of 8 chars -> 0.75
    assert indel([ex], ["1243"]).tolist() == [0.75]


def test_constructor_errors_name_the_fix():
    with pytest.raises(ValueError, match="kind must be one of"):
        SyntheticTask(kind="mul")
    with pytest.raises(ValueError, match="levels must be a non-empty list"):
        SyntheticTask(levels=[0, 3])
    with pytest.raises(ValueError, match="num_validation must be >= 0"):
        SyntheticTask(num_validation=-1)
