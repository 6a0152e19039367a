"""Reward / Task interfaces: failures scored 0 and counted, scales, weighted sums, splits."""

import logging
import math
import signal
import threading
import time

import pytest
import torch

from sgrpo.types import Example
from tasks import EditSimilarity, ExactMatch, Reward, RewardResult, SampleReward, Task, WeightedSum
from tasks.base import fill
from tasks.pool import WorkerPool


class Scripted(SampleReward):
    """Scores a completion by what it says: a number, "raise", "hang", "nan", or "big"."""

    name = "scripted"

    def score_one(self, example, completion):
        if completion == "raise":
            raise RuntimeError("boom")
        if completion == "hang":
            time.sleep(60)
        if completion == "nan":
            return math.nan
        if completion == "big":
            return 3.0
        if completion == "labelled":
            return 0.5, "half"
        return float(completion)


def _batch(*completions):
    return [Example("q", "a")] * len(completions), list(completions)


def test_in_process_failures_score_zero_and_are_counted():
    result = Scripted().score(*_batch("1", "raise", "0.25", "nan", "big", "labelled"))
    assert result.total.tolist() == [1.0, 0.0, 0.25, 0.0, 0.0, 0.5]
    assert result.failures == 3  # raise, nan, 3.0 outside [0, 1]
    assert result.counts == {"half": 1, "error": 3}  # failures are labelled too
    assert result.total.dtype == torch.float32 and set(result.parts) == {"scripted"}


def test_pool_hang_and_raise_score_zero_and_pool_recovers():
    reward = Scripted(workers=1, timeout=0.5)
    start = time.perf_counter()
    result = reward.score(*_batch("1", "hang", "0.5", "raise", "1"))
    elapsed = time.perf_counter() - start
    assert result.total.tolist() == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert result.failures == 2 and result.counts == {"timeout": 1, "error": 1}
    assert elapsed < 10  # the 60 s sleep was cut at 0.5 s and the pool restarted
    assert reward.score(*_batch("0.75")).total.tolist() == [0.75]  # the restarted pool works


def test_scale_pm1_maps_binary_rewards_and_failures_to_minus_one():
    # {0, 1} -> {-1, +1}; a failure is a wrong answer: -1
    result = Scripted(scale="pm1").score(*_batch("1", "0", "raise"))
    assert result.total.tolist() == [1.0, -1.0, -1.0]
    examples = [Example("s:21=", "12")] * 2
    assert ExactMatch(scale="pm1")(examples, ["12", "21"]).tolist() == [1.0, -1.0]


def test_weighted_sum_keeps_unweighted_parts_and_sums_failures():
    examples = [Example("s:321=", "123")] * 3
    completions = ["123", "132", "raise"]
    exact, edit = ExactMatch(), EditSimilarity()
    result = WeightedSum([exact, edit, Scripted()], [1.0, 0.5, 2.0]).score(examples, ["123", "132", "1"])
    # edit: "132" vs "123" is 2 substitutions of 3 chars -> 1/3; "1" vs "123": 2 insertions -> 1/3
    torch.testing.assert_close(result.parts["edit"], torch.tensor([1.0, 1 / 3, 1 / 3]), atol=1e-8, rtol=1e-5)
    assert result.parts["exact_match"].tolist() == [1.0, 0.0, 0.0]
    # total = 1 * exact + 0.5 * edit + 2 * scripted (scripted reads "123" -> 123 invalid -> 0, "1" -> 1)
    torch.testing.assert_close(result.total, torch.tensor([1.5, 0.5 / 3, 0.5 / 3 + 2.0]), atol=1e-8, rtol=1e-5)
    assert result.failures == 2  # "123" and "132" are not numbers in [0, 1]
    failing = WeightedSum([Scripted(), Scripted(name="other")]).score(examples, completions)
    assert failing.failures == 2 * 3  # 123, 132 out of range; "raise"


def test_weighted_sum_validation():
    with pytest.raises(ValueError, match="unique"):
        WeightedSum([ExactMatch(), ExactMatch()])
    with pytest.raises(ValueError, match="one number per reward"):
        WeightedSum([ExactMatch()], [1.0, 2.0])


def test_reward_validation_names_the_fix():
    with pytest.raises(ValueError, match="scale must be '01' or 'pm1'"):
        ExactMatch(scale="11")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ExactMatch(timeout=0)
    with pytest.raises(ValueError, match="one completion per example"):
        ExactMatch()([Example("q", "a")], ["a", "b"])
    with pytest.raises(ValueError, match="1-D float32"):
        RewardResult(torch.zeros(2, dtype=torch.float64), {})


class Toy(Task):
    def load(self, split):
        return [Example(f"{split}{i}", str(i)) for i in range(5)]

    def success(self, example, completion):
        if completion == "raise":
            raise RuntimeError("boom")
        return completion == example.answer


def test_task_splits_limits_and_robust_successes():
    task = Toy(ExactMatch(), max_train_examples=2, max_eval_examples=3)
    assert [e.prompt for e in task.examples("train")] == ["train0", "train1"]
    assert len(task.examples("validation")) == len(task.examples("test")) == 3
    with pytest.raises(ValueError, match="unknown split 'dev'; use one of train, validation, test"):
        task.examples("dev")
    examples = task.examples("train")
    assert task.successes(examples, ["0", "raise"]).tolist() == [True, False]
    with pytest.raises(ValueError, match="max_train_examples must be >= 1"):
        Toy(ExactMatch(), max_train_examples=0)


def test_a_failing_success_test_is_named_at_its_first_failure_and_at_each_tenfold(caplog):
    task = Toy(ExactMatch())
    examples = task.examples("train")[:2]
    with caplog.at_level(logging.WARNING, logger="tasks.base"):
        for _ in range(10):  # 10 failures: warned at the 1st and the 10th
            assert task.successes(examples, ["0", "raise"]).tolist() == [True, False]
    warned = [r.getMessage() for r in caplog.records if r.name == "tasks.base"]
    assert warned == [
        "Toy: the success test failed on 1 of 2 completions (first: RuntimeError: boom); 1 so far, each counted as "
        "not successful",
        "Toy: the success test failed on 1 of 2 completions (first: RuntimeError: boom); 10 so far, each counted as "
        "not successful",
    ]


def test_a_success_grader_that_raises_is_named(caplog):
    class Raising(SampleReward):
        def score_one(self, example, completion):
            raise ValueError("bad gold")

    class Graded(Toy):
        success_grader = Raising(name="success")

    with caplog.at_level(logging.WARNING, logger="tasks.base"):
        assert Graded(ExactMatch()).successes([Example("q", "1")] * 3, ["1", "2", "3"]).tolist() == [False] * 3
    assert [r.getMessage() for r in caplog.records if r.name == "tasks.base"] == [  # (tasks.reward names the first)
        "Graded: the success test failed on 3 of 3 completions (error 3); 3 so far, each counted as not successful"
    ]


def test_a_success_test_shared_with_the_reward_that_fails_is_named(caplog):
    """Where the reward grades as the success test does, ``Task.score`` takes success from that one grading; its
    failures (a ``val_reward`` validation's timeouts) went untallied by the success warning."""

    class Sometimes(SampleReward):
        def score_one(self, example, completion):
            if completion == "x":
                raise ValueError("bad answer")
            return float(completion == example.answer), "graded"

    class Shared(Toy):
        success_grader = Sometimes(name="success")

    examples = [Example("q", "1")] * 3
    for reward, detail in ((Sometimes(name="r"), "error 1"),
                           (WeightedSum([Sometimes(name="r"), ExactMatch()], [1.0, 0.5]), "error 1")):  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tasks.base"):
            result = Shared(reward).score(examples, ["1", "x", "2"])
        assert result.success.tolist() == [True, False, False]
        assert [r.getMessage() for r in caplog.records if r.name == "tasks.base"] == [
            f"Shared: the success test failed on 1 of 3 completions ({detail}); 1 so far, each counted as not "
            "successful"], type(reward).__name__


def test_fill_leaves_latex_braces():
    assert fill("{question} in \\boxed{}", question="1+1") == "1+1 in \\boxed{}"


def test_restart_works_when_the_parent_traps_sigterm():
    # Lightning installs a SIGTERM handler; forked workers must still die on the pool's terminate()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    pool = WorkerPool(1)
    try:
        outcomes = pool.run(time.sleep, [(30.0,), (0.0,)], timeout=0.5)
        assert [o.ok for o in outcomes] == [False, True]
    finally:
        pool.close()
        signal.signal(signal.SIGTERM, previous)


def test_scoring_from_a_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(Scripted(workers=1).score(*_batch("1", "raise"))))
    thread.start()
    thread.join(30)
    assert results[0].total.tolist() == [1.0, 0.0] and results[0].failures == 1


class Plain(Reward):
    """A reward that implements ``score`` itself: it raises, returns NaN / inf, or too few values."""

    name = "plain"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def score(self, examples, completions):
        if self.mode == "raise":
            raise RuntimeError("the grader crashed")
        total = torch.tensor({"nan": [math.nan, 1.0, -math.inf], "short": [1.0]}[self.mode])
        return RewardResult(total, {self.name: total})


def test_a_plain_reward_that_raises_scores_zero_and_is_counted():
    result = Plain("raise").score(*_batch("a", "b", "c"))
    assert result.total.tolist() == [0.0, 0.0, 0.0] and result.failures == 3 and result.counts == {"error": 3}
    assert Plain("raise")(*_batch("a")).tolist() == [0.0]  # through __call__ too


def test_non_finite_rewards_score_zero_and_are_counted():
    result = Plain("nan").score(*_batch("a", "b", "c"))
    assert result.total.tolist() == [0.0, 1.0, 0.0] and result.parts["plain"].tolist() == [0.0, 1.0, 0.0]
    assert result.failures == 2 and result.counts == {"error": 2}


def test_a_result_of_the_wrong_length_names_the_reward_and_both_lengths():
    with pytest.raises(ValueError, match="reward 'plain' returned 1 rewards for 3 completions"):
        Plain("short").score(*_batch("a", "b", "c"))


def test_a_weighted_sum_keeps_the_components_that_work():
    examples = [Example("s:21=", "12")] * 2
    result = WeightedSum([ExactMatch(), Plain("raise")]).score(examples, ["12", "21"])
    assert result.total.tolist() == [1.0, 0.0] and result.failures == 2


def test_rewards_and_tasks_show_their_settings():
    assert (
        repr(ExactMatch(normalize=True))
        == "ExactMatch(scale='01', name='exact_match', workers=0, timeout=10.0, normalize=True)"
    )
    assert repr(Toy(ExactMatch(), max_train_examples=2)).startswith("Toy(reward=ExactMatch(scale='01'")
    assert "_cache" not in repr(Toy(ExactMatch()))  # private state stays out


def test_a_process_with_cuda_starts_its_pool_from_a_forkserver(monkeypatch):
    """fork copies a process's threads' held locks but not the threads: after CUDA (NCCL's threads) the pool's
    workers come from a forkserver; before it, fork (fast)."""
    import tasks.pool

    monkeypatch.setattr(tasks.pool.sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert tasks.pool._start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert tasks.pool._start_method() == "forkserver"


@pytest.mark.slow
def test_a_pool_started_from_a_forkserver_scores(monkeypatch):
    """8 s: the forkserver and its worker import their modules afresh."""
    import tasks.pool

    monkeypatch.setattr(tasks.pool, "_start_method", lambda: "forkserver")
    pool = WorkerPool(1)
    try:
        assert pool.run(math.sqrt, [(4.0,)], timeout=30)[0].value == 2.0  # a working pool from the forkserver
    finally:
        pool.close()


def test_tasks_imports_a_grader_only_when_a_task_uses_it():
    """``import tasks`` and the tasks that grade neither math nor chrF/BLEU load no sympy, math-verify or sacrebleu
    (~45 MiB of RSS and a second of start-up); every public name still resolves, and a grader loads when used."""
    import subprocess
    import sys

    script = (
        "import sys, tasks, tasks.synthetic, tasks.countdown, tasks.calculator, tasks.text, tasks.similarity\n"
        "heavy = ('sympy', 'math_verify', 'sacrebleu')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "assert all(getattr(tasks, name) is not None for name in tasks.__all__)\n"
        "assert set(tasks.__all__) <= set(dir(tasks)) and tasks.ChrF().similarity('ab', 'ab') == 1.0\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "try:\n    tasks.Nope\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == [
        "[]", "['math_verify', 'sacrebleu', 'sympy']", "module 'tasks' has no attribute 'Nope'"
    ]

