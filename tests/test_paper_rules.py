"""Issue 32, items 2 and 7: the authors' math grading as a named mode of the math reward, their holdout, their
DeepMath questions and references, and the one-line errors of a recipe that cannot be honoured."""

import hashlib
import importlib.metadata
import json

import pytest

from sgrpo.types import Example
from tasks import Countdown, DeepMath, MathVerifyReward, OpenThoughts, PaperMathVerify, grade_paper_math, paper_holdout
from tasks.holdout import paper_uid, prompt_uid
from tasks.paper import SYSTEM_PROMPT

# (gold, completion, the authors' grade, sgrpo's own grade (MathVerifyReward as the paper configs set it before))
MATH = [
    ("3", "\\boxed{2} ... so \\boxed{3}", 0.0, 1.0),  # every box read together: {2, 3} is not 3
    ("0.866", "\\boxed{\\frac{\\sqrt3}{2}}", 0.0, 1.0),  # no rounded-decimal tolerance
    ("1.2e5", "\\boxed{120000}", 0.0, 1.0),  # no e-notation respelling
    ("5", "\\fbox{5}", 0.0, 1.0),  # no \fbox
    ("\\mathbb{Z}", "\\boxed{\\mathbb Z}", 0.0, 1.0),  # no \mathbb respelling
    ("4", "\\boxed{4}", 1.0, 1.0),
    ("4", "<think>maybe 5</think> The answer is 4.", 1.0, 1.0),
    ("\\frac{1}{2}", "<answer>0.5</answer>", 1.0, 1.0),
    ("2, 3", "\\boxed{2}, \\boxed{3}", 1.0, 1.0),
    ("1,710", "\\boxed{1710}", 1.0, 1.0),
    ("4", "It is 5.", 0.0, 0.0),
]


def test_paper_math_grading_is_the_authors():
    examples = [Example("q", gold) for gold, *_ in MATH]
    completions = [completion for _, completion, *_ in MATH]
    paper = PaperMathVerify(workers=0).score(examples, completions)
    assert paper.total.tolist() == [authors for *_, authors, _ in MATH] and paper.failures == 0
    own = MathVerifyReward(final_text=True, require_box=False, require_think=False, workers=0)
    assert own(examples, completions).tolist() == [sgrpo for *_, sgrpo in MATH]  # sgrpo's own grading stays
    assert grade_paper_math("3", "no number here") == (0.0, "unparsed")
    assert isinstance(PaperMathVerify(), MathVerifyReward)  # DeepMath and Polaris take success from it


def test_math_verify_versions_differ_on_a_boxed_percentage():
    """math-verify 0.9 reads ``\\boxed{5\\%}`` as 5 against gold 5; the authors' 0.8.0 does not (docs/paper.md)."""
    version = importlib.metadata.version("math-verify")
    expected = 0.0 if version.startswith("0.8.") else 1.0
    assert grade_paper_math("5", "\\boxed{5\\%}")[0] == expected
    assert grade_paper_math("0.05", "\\boxed{5\\%}")[0] == 1.0  # both versions


def test_paper_uid_and_holdout_by_hand():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q é"}]
    spelled = '[{"content": "S", "role": "system"}, {"content": "Q \\u00e9", "role": "user"}]'  # json's defaults
    assert paper_uid(messages) == hashlib.sha256(spelled.encode()).hexdigest() == prompt_uid("S", "Q é")
    rows = [{"q": f"q{i % 25}", "i": i} for i in range(30)]  # 25 distinct prompts, 5 repeated
    uid = lambda row: prompt_uid(None, row["q"])  # noqa: E731
    ids = sorted({uid(r) for r in rows}, key=lambda u: hashlib.sha256(f"7:{u}".encode()).digest())
    split = paper_holdout(rows, uid, 500, seed=7)
    assert {uid(r) for r in split["validation"]} == set(ids[:2])  # min(500, max(1, 25 // 10)) = 2
    assert len(split["train"]) + len(split["validation"]) == 30
    assert [r["i"] for r in split["train"]] == sorted(r["i"] for r in split["train"])
    assert {uid(r) for r in paper_holdout(rows[:12], uid, 500, seed=7)["validation"]} == {
        min({uid(r) for r in rows[:12]}, key=lambda u: hashlib.sha256(f"7:{u}".encode()).digest())
    }  # max(1, 12 // 10) = 1
    with pytest.raises(ValueError, match="two distinct prompts"):
        paper_holdout(rows[:1], uid, 500, seed=7)


def test_countdown_paper_holdout_selects_the_authors_prompts(tmp_path):
    rows = [{"target": 10 + i, "nums": [i, 2, 3]} for i in range(40)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = Countdown(path=str(tmp_path / "c.jsonl"), validation_size=500, seed=42, holdout="paper")

    def uid(row):  # the authors' record: system + the prompt built from nums and target, json-dumped, hashed
        user = (f"Using the numbers {row['nums']}, create an equation that equals {row['target']}. Use only +, -, *, "
                "/ and parentheses, and use each number exactly once. Show your work in <think> </think> tags and "
                "return the final expression in <answer> </answer> tags.")  # fmt: skip
        text = json.dumps([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
                          sort_keys=True)  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()

    ranked = sorted(rows, key=lambda r: hashlib.sha256(f"42:{uid(r)}".encode()).digest())
    assert [e.answer for e in task.examples("validation")] == [str(r["target"]) for r in rows if r in ranked[:4]]
    hashed = Countdown(path=str(tmp_path / "c.jsonl"), validation_size=500, seed=42)  # sgrpo's own ranking
    assert {e.answer for e in hashed.examples("validation")} != {e.answer for e in task.examples("validation")}


def test_deepmath_strips_questions_and_falls_back_to_the_final_answer(tmp_path):
    rows = [{"question": f"  Q{i}?\n", "final_answer": f"{i}", "r1_solution_1": "<think>x</think>  ",
             "r1_solution_2": f"<think>y</think> \\boxed{{{i}}} long" if i else None} for i in range(12)]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DeepMath(path=str(tmp_path / "d.jsonl"), validation_size=1000, seed=42, holdout="paper",
                    system_prompt=SYSTEM_PROMPT, reference_solutions=True)  # fmt: skip
    examples = {e.metadata["question"]: e for s in ("train", "validation") for e in task.examples(s)}
    assert len(task.examples("validation")) == 1  # max(1, 12 // 10)
    assert examples["Q0?"].prompt[-1]["content"] == "Q0?"  # stripped, as the authors strip it
    assert examples["Q0?"].metadata["reference"] == "0"  # no non-empty final text: final_answer
    assert examples["Q3?"].metadata["reference"] == "\\boxed{3} long"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: Countdown(path=p, holdout="paper", validation_size=0.1), "validation_size must be a count"),
        (lambda p: Countdown(path=p, holdout="paper", validation_size=500, test_size=10), "test_size must be 0"),
        (lambda p: Countdown(path=p, holdout="authors"), "holdout must be 'hash' or 'paper'"),
        (lambda p: OpenThoughts(path=p, holdout="paper", validation_size=0), "validation_size must be a count"),
        (lambda p: DeepMath(path=p, holdout="paper", validation_size=0.01), "validation_size must be a count"),
    ],
)
def test_a_holdout_that_cannot_be_honoured_fails_in_one_line_naming_the_key(make, needle, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"target": 1, "nums": [1]}\n')
    with pytest.raises(ValueError, match=needle) as error:
        make(str(path))
    assert "\n" not in str(error.value)
