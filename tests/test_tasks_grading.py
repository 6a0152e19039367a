"""Grade once: a task whose reward grades as its success test does gets both from one grading (Task.score)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tasks.mathgrade
from sgrpo.types import Example
from tasks import (
    GSM8K,
    DeepMath,
    EditSimilarity,
    ExactMatch,
    MathVerifyReward,
    MeetingBank,
    PoetryClassification,
    PoetryWriting,
    RougeL,
)
from tasks.base import SampleReward, Task, WeightedSum

FIXTURES = Path(__file__).parent / "fixtures"


class Counting(SampleReward):
    """Exact match that counts its gradings (in this process: workers=0); ``strip`` is a grading setting."""

    name = "counting"
    calls = 0

    def __init__(self, strip: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.strip = strip
        self._broken = False  # raw_scores raises as a whole (not a grading setting: private)

    def raw_scores(self, examples, completions):
        if self._broken:
            raise OSError("the grading service is down")
        return super().raw_scores(examples, completions)

    def score_one(self, example, completion):
        Counting.calls += 1
        return float((completion.strip() if self.strip else completion) == example.answer)


class Graded(Task):
    """Success: ``Counting(name="success")`` reaches 1."""

    def __init__(self, reward=None, **settings) -> None:
        super().__init__(reward or Counting(), **settings)
        self.success_grader = Counting(name="success")

    def load(self, split):
        return [Example("q", "12")]


EXAMPLES = [Example("q", "12")] * 4
COMPLETIONS = ["12", " 12 ", "21", "1"]


@pytest.fixture(autouse=True)
def _reset_counts():
    Counting.calls = 0


@pytest.mark.parametrize("scale", ["01", "pm1"])
def test_a_reward_that_grades_as_the_success_test_grades_each_completion_once(scale):
    task = Graded(Counting(scale=scale))
    result = task.score(EXAMPLES, COMPLETIONS)
    assert Counting.calls == 4  # reward.score then successes() graded 8 times
    assert result.success.tolist() == [True, True, False, False]
    assert result.total.tolist() == ([1.0, 1.0, 0.0, 0.0] if scale == "01" else [1.0, 1.0, -1.0, -1.0])
    assert result.parts == {"counting": result.total} and result.failures == 0
    Counting.calls = 0
    assert torch.equal(task.successes(EXAMPLES, COMPLETIONS), result.success) and Counting.calls == 4
    assert task.success(EXAMPLES[0], "21") is False and task.success(EXAMPLES[0], "12") is True


def test_a_reward_that_grades_otherwise_is_scored_and_tested_apart():
    task = Graded(Counting(strip=False))  # " 12 " scores 0 but succeeds
    result = task.score(EXAMPLES, COMPLETIONS)
    assert Counting.calls == 8
    assert result.total.tolist() == [1.0, 0.0, 0.0, 0.0] and result.success.tolist() == [True, True, False, False]


def test_a_scoring_that_fails_as_a_whole_is_counted_and_success_is_tested_apart():
    reward = Counting()
    reward._broken = True
    result = Graded(reward).score(EXAMPLES, COMPLETIONS)
    assert result.total.tolist() == [0.0] * 4 and result.failures == 4  # the protected score: 0, counted
    assert result.success.tolist() == [True, True, False, False]  # from the success grader


def test_a_task_without_a_grader_implements_success():
    class Bare(Task):
        def load(self, split):
            return []

    with pytest.raises(NotImplementedError, match="implement success"):
        Bare(ExactMatch()).success(EXAMPLES[0], "12")
    assert Bare(ExactMatch()).successes(EXAMPLES[:1], ["12"]).tolist() == [False]  # counted as not successful


def test_deepmath_grades_once_with_its_reward_on_either_scale(monkeypatch):
    graded = []
    real = tasks.mathgrade.grade_math
    monkeypatch.setattr(tasks.mathgrade, "grade_math", lambda *args: graded.append(args) or real(*args))
    task = DeepMath(path=str(FIXTURES / "deepmath.jsonl"), reward=MathVerifyReward(workers=0, scale="pm1"))
    example = task.examples("train")[0]
    completions = ["\\boxed{" + example.answer + "}", "\\boxed{7}", "no box"]
    result = task.score([example] * 3, completions)
    assert len(graded) == 3  # one math-verify grading per completion (it was two)
    assert result.total.tolist() == [1.0, -1.0, -1.0] and result.success.tolist() == [True, False, False]
    assert result.counts == {"correct": 1, "wrong": 1, "no_box": 1}
    other = DeepMath(path=str(FIXTURES / "deepmath.jsonl"), reward=ExactMatch())  # success: math-verify's defaults
    assert not other.reward.grades_like(other.success_grader)


def test_gsm8k_and_meetingbank_defaults_grade_once(monkeypatch):
    graded = []
    real = RougeL.similarity
    monkeypatch.setattr(RougeL, "similarity", lambda self, *args: graded.append(args) or real(self, *args))
    task = MeetingBank(path=str(FIXTURES / "meetingbank.jsonl"))
    example = task.examples("train")[0]
    result = task.score([example] * 2, [example.answer, "Motion carries."])
    assert len(graded) == 2 and result.success.tolist() == [True, False]
    gsm8k = GSM8K(path=str(FIXTURES / "gsm8k.jsonl"))
    assert gsm8k.reward.grades_like(gsm8k.success_grader)  # NumericMatch() and NumericMatch(name="success")
    writing = PoetryWriting(path=str(FIXTURES / "poetry.jsonl"))  # ChrF() reward, ChrF() >= 0.5 success
    assert writing.reward.grades_like(writing.success_grader)
    poetry = PoetryClassification(path=str(FIXTURES / "poetry.jsonl"))  # chrF reward, exact-match success
    assert not poetry.reward.grades_like(poetry.success_grader)


def test_the_policy_scores_a_step_with_one_grading(tmp_path):
    from estimators import GRPO
    from sgrpo.model.tiny import ensure_tiny_model
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from tests.engine_helpers import run_steps

    class Watched(Graded):
        def load(self, split):
            return [Example(f"s:{d}=", "".join(sorted(d))) for d in ("31", "402", "75", "980")]

        def successes(self, examples, completions):  # the policy must not test success apart in training
            raise AssertionError("graded twice")

    model = ensure_tiny_model(tmp_path / "tiny")
    rollout = HFRollout(max_new_tokens=4)
    policy = GRPOPolicy(
        str(model), Watched(), GRPO(), rollout, group_size=2, prompts_per_step=2, log_completions_every=0
    )
    run_steps(policy, steps=1, root=str(tmp_path / "run"))
    assert Counting.calls == 2 * 2  # prompts x group size, once each


def test_a_weighted_sum_with_a_part_that_grades_as_the_success_test_grades_it_once():
    task = Graded(WeightedSum([EditSimilarity(), Counting(scale="pm1")], weights=[1.0, 2.0]))
    result = task.score(EXAMPLES, COMPLETIONS)
    assert Counting.calls == 4 and result.success.tolist() == [True, True, False, False]
    assert result.parts["counting"].tolist() == [1.0, 1.0, -1.0, -1.0]
    Counting.calls = 0
    other = Graded(WeightedSum([EditSimilarity(), Counting(strip=False)])).score(EXAMPLES, COMPLETIONS)
    assert Counting.calls == 8 and other.success.tolist() == [True, True, False, False]  # graded apart


def test_a_validation_with_val_reward_grades_each_completion_once():
    """``val_reward: true`` logs the training reward of validation completions: their success comes from the same
    grading where the reward grades as the success test does (it graded each completion twice)."""
    from lightning.pytorch import Trainer

    from estimators import GRPO
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from tasks.synthetic import SyntheticTask

    class CountedSort(SyntheticTask):
        def __init__(self, **kwargs) -> None:
            super().__init__(kind="sort", levels=[3], num_train=4, num_validation=3, reward=Counting(), **kwargs)
            self.success_grader = Counting(name="success")

    model = str(Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model")
    policy = GRPOPolicy(model, CountedSort(), GRPO(), rollout=HFRollout(max_new_tokens=4), val_samples=2,
                        val_reward=True)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    metrics = trainer.validate(policy, verbose=False)[0]
    assert Counting.calls == 3 * 2  # 3 prompts x 2 samples, graded once each
    assert metrics["val/reward"] == metrics["val/accuracy"]  # the same grading, on the 0/1 scale
