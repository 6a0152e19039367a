"""DeepMath: loaders (jsonl, parquet, trl-lib test schema), held-out splits, math-verify grading."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from sgrpo.types import Example
from tasks import DeepMath, MathVerifyReward, grade_math
from tasks.deepmath import SYSTEM_PROMPT
from tasks.mathgrade import last_boxed
from tasks.similarity import final_text

FIXTURES = Path(__file__).parent / "fixtures"
JSONL = str(FIXTURES / "deepmath.jsonl")
ROWS = [json.loads(line) for line in Path(JSONL).read_text().splitlines()]
ROOT = Path(__file__).parents[1]


def test_examples_follow_the_schema_and_prompt():
    task = DeepMath(path=JSONL, validation_size=0)
    examples = task.examples("train")
    assert [e.answer for e in examples] == [r["final_answer"] for r in ROWS]
    assert [e.difficulty for e in examples] == [5.0, 5.5, 6.0, 5.0, 5.0]
    assert examples[0].prompt == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": ROWS[0]["question"]},
    ]
    assert examples[1].metadata["topic"].startswith("Mathematics -> Algebra")
    assert DeepMath(path=JSONL, system_prompt=None).examples("train")[0].prompt[0]["role"] == "user"


def test_parquet_gives_the_same_examples():
    from_parquet = DeepMath(path=str(FIXTURES / "deepmath.parquet"), validation_size=2, seed=7)
    from_jsonl = DeepMath(path=JSONL, validation_size=2, seed=7)
    for split in ("train", "validation"):
        fields = [[(e.prompt, e.answer, e.difficulty) for e in t.examples(split)] for t in (from_parquet, from_jsonl)]
        assert fields[0] == fields[1]


def test_all_r1_solutions_grade_correct():
    task = DeepMath(path=JSONL, validation_size=0)
    examples = [e for e in task.examples("train") for _ in range(3)]
    completions = [r[f"r1_solution_{k}"] for r in ROWS for k in (1, 2, 3)]
    result = task.reward.score(examples, completions)
    assert result.total.tolist() == [1.0] * 15 and result.failures == 0
    assert task.successes(examples, completions).all()


@pytest.mark.parametrize(
    ("gold", "response", "expected"),
    [
        ("-\\dfrac{9}{2}", "<think>\nx\n</think>\nFinal answer: \\boxed{-4.5}", (1.0, "correct")),
        ("\\dfrac{\\pi^2}{6}", "\\boxed{\\pi^2/6}", (1.0, "correct")),
        ("Yes", "\\boxed{yes}", (1.0, "correct")),  # string fallback, case-insensitive
        ("Yes", "\\boxed{\\text{YES}}", (1.0, "correct")),
        ("Yes", "\\boxed{No}", (0.0, "wrong")),
        ("504", "\\boxed{505}", (0.0, "wrong")),
        ("1", "\\boxed{1} or maybe \\boxed{2}", (0.0, "wrong")),  # the last box counts
        ("504", "<think>\nI think \\boxed{504}\n</think>\nThe answer is 504.", (0.0, "no_box")),
        ("504", "<think>\ncut off while thinking \\boxed{504}", (0.0, "no_box")),
        ("504", "the answer is \\boxed{}", (0.0, "unparsed")),
        ("(-\\infty, 0)", "\\boxed{(-\\infty,0)}", (1.0, "correct")),
    ],
)
def test_grade_math(gold, response, expected):
    assert grade_math(gold, response) == expected


def test_grade_without_required_box_reads_the_text():
    assert grade_math("18", "The answer is 18 dollars.", require_box=False) == (1.0, "correct")


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{\\frac{1}{2") is None and last_boxed("none") is None


def test_reward_counts_missing_boxes_and_failures_and_scales():
    ex = Example("q", "504")
    reward = MathVerifyReward(scale="pm1")
    result = reward.score([ex] * 3, ["\\boxed{504}", "504", "\\boxed{7}"])
    assert result.total.tolist() == [1.0, -1.0, -1.0]
    assert result.counts == {"correct": 1, "no_box": 1, "wrong": 1} and result.failures == 0
    bad_gold = Example("q", "")  # a gold answer that does not parse: a failure, scored 0
    broken = MathVerifyReward().score([bad_gold], ["\\boxed{1}"])
    assert broken.total.tolist() == [0.0] and broken.failures == 1


def test_in_process_grading_matches_the_pool():
    examples = [Example("q", r["final_answer"]) for r in ROWS]
    completions = [r["r1_solution_3"] for r in ROWS[:4]] + ["\\boxed{No}"]
    pooled = MathVerifyReward().score(examples, completions)
    local = MathVerifyReward(workers=0).score(examples, completions)
    assert torch.equal(pooled.total, local.total) and pooled.total.tolist() == [1, 1, 1, 1, 0]


def test_held_out_split_is_deterministic_and_disjoint():
    a = DeepMath(path=JSONL, validation_size=2, test_size=1, seed=1)
    b = DeepMath(path=JSONL, validation_size=2, test_size=1, seed=1)
    splits = {s: [e.answer for e in a.examples(s)] for s in ("train", "validation", "test")}
    assert splits == {s: [e.answer for e in b.examples(s)] for s in splits}
    assert [len(v) for v in splits.values()] == [2, 2, 1]
    assert sorted(sum(splits.values(), [])) == sorted(r["final_answer"] for r in ROWS)
    other = DeepMath(path=JSONL, validation_size=2, test_size=1, seed=2)
    assert any([e.answer for e in other.examples(s)] != splits[s] for s in splits)
    assert len(DeepMath(path=JSONL).examples("validation")) == 1  # default 1 % of 5 rows, at least 1


def test_trl_test_split_is_removed_from_train_and_gets_difficulty():
    task = DeepMath(path=JSONL, validation_size=1, test_path=str(FIXTURES / "deepmath_trl_test.jsonl"))
    test = task.examples("test")
    assert [e.answer for e in test] == ["-\\dfrac{9}{2}", "504", "720"]
    assert [e.difficulty for e in test] == [5.0, 5.5, None]  # joined from path by question text
    assert test[0].prompt[0]["content"] == SYSTEM_PROMPT
    seen = {e.answer for s in ("train", "validation") for e in task.examples(s)}
    assert seen == {"\\dfrac{\\pi^2}{6}", "481", "Yes"}
    trl_only = DeepMath(path=str(FIXTURES / "deepmath_trl_test.jsonl"), validation_size=0)
    assert [e.difficulty for e in trl_only.examples("train")] == [None] * 3


def test_a_trl_test_split_with_reference_solutions_loads_with_answers_as_references(caplog):
    """The similarity variant with the test file the docstring suggests (trl-lib's, no R1 solutions) failed the
    load of every split, train included; a test file in zwhe99's schema lost its solutions (not read)."""
    with caplog.at_level("WARNING", logger="tasks.deepmath"):
        task = DeepMath(path=JSONL, validation_size=1, test_path=str(FIXTURES / "deepmath_trl_test.jsonl"),
                        reference_solutions=True)  # fmt: skip
        assert len(task.examples("train")) == 2 and len(task.examples("validation")) == 1
        test = task.examples("test")
    assert [e.answer for e in test] == ["-\\dfrac{9}{2}", "504", "720"]
    assert not any("reference" in e.metadata for e in test)  # the similarity reward then reads example.answer
    assert caplog.text.count("has no r1_solution_1/r1_solution_2/r1_solution_3") == 1
    zwhe99 = DeepMath(path=JSONL, validation_size=0, test_path=JSONL, reference_solutions=True)
    first = ROWS[0]
    assert zwhe99.examples("test")[0].metadata["reference"] == min(
        (final_text(first[k]) for k in ("r1_solution_1", "r1_solution_2", "r1_solution_3")), key=len)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DeepMath(path="tests/fixtures/missing.jsonl")
    with pytest.raises(ValueError, match="unknown split"):
        DeepMath(path=JSONL).examples("dev")
    with pytest.raises(ValueError, match="no 'test' split"):
        DeepMath(path=JSONL).examples("test")
    with pytest.raises(ValueError, match="hold out 7 of the 5 rows"):
        DeepMath(path=JSONL, validation_size=7).examples("train")
    with pytest.raises(ValueError, match="validation_size must be a count"):
        DeepMath(path=JSONL, validation_size=1.5)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(ValueError, match="expected the DeepMath schema"):
        DeepMath(path=str(wrong), validation_size=0).examples("train")


def test_readme_snippet_runs_as_a_script(tmp_path):
    script = tmp_path / "snippet.py"  # no `if __name__ == "__main__"` guard, as a reader would paste it
    script.write_text(
        "from tasks.deepmath import DeepMath\n"
        'task = DeepMath(path="tests/fixtures/deepmath.jsonl")\n'
        'ex = task.examples("train")[0]\n'
        'print(task.reward([ex], ["... so the answer is \\\\boxed{" + ex.answer + "}"]))\n'
    )
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tensor([1.])"


def test_in_process_grading_off_the_main_thread():
    # math-verify's signal.alarm timeouts only work in the main thread: they are disabled elsewhere
    out = []
    reward = MathVerifyReward(workers=0)
    thread = threading.Thread(
        target=lambda: out.append(reward.score([Example("q", "\\dfrac{1}{2}")], ["\\boxed{0.5}"]))
    )
    thread.start()
    thread.join(30)
    assert out[0].total.tolist() == [1.0] and out[0].failures == 0
