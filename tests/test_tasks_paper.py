"""The SoftmaxGRPO paper's tasks (issue 23) on fixtures in their sources' schemas, and the hash-ranked holdout.

Real columns (the datasets' cards): Jiayi-Pan/Countdown-Tasks-3to4 ``target`` (int), ``nums`` (list of int);
open-thoughts/OpenThoughts3-1.2M ``difficulty``, ``source``, ``domain``, ``conversations`` (``{from, value}``
turns, human then gpt); POLARIS-Project/Polaris-Dataset-53K ``problem``, ``answer``, ``difficulty`` (a pass rate
"k/8"); math-ai/aime25 ``problem``, ``answer``, ``id``; HuggingFaceH4/MATH-500 ``problem``, ``solution``,
``answer``, ``subject``, ``level``, ``unique_id``; openai/gsm8k and zwhe99/DeepMath-103K as in their own tests.
ASSUMED, not verified (its card lists no columns): HuggingFaceTB/Countdown-Task-GOLD's ``messages``
(``{role, content}``: system, user, assistant); the task also reads ``target`` / ``nums`` columns if present.
"""

import hashlib
import json
import random
from pathlib import Path

import pytest

from sgrpo.types import Example
from tasks import (
    GSM8K,
    Countdown,
    CountdownGold,
    DeepMath,
    OpenThoughts,
    Polaris,
    WordSimilarity,
    final_text,
    final_text_verifier,
    hash_holdout,
)
from tasks.paper import COUNTDOWN_TEMPLATE, MATH_TEMPLATE, OPENTHOUGHTS_SYSTEM_PROMPT, SYSTEM_PROMPT

F = Path(__file__).parent / "fixtures"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (F / name).read_text().splitlines()]


def test_hash_holdout_ranks_distinct_prompts_by_hash_and_keeps_repeats_together():
    prompts = [f"q{i}" for i in range(25)]
    data = [{"q": p, "i": i} for i, p in enumerate(prompts + prompts[:5])]  # 30 rows, 25 distinct prompts
    split = hash_holdout(data, lambda r: r["q"], {"validation": 5, "test": 1}, seed=42)
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(f"42\n{p}".encode()).hexdigest())
    # min(5, floor(10 % of 25) = 2) validation prompts: the first two ranks; the test split the next min(1, 2)
    assert {r["q"] for r in split["validation"]} == set(ranked[:2])
    assert {r["q"] for r in split["test"]} == {ranked[2]}
    assert sum(map(len, split.values())) == 30
    for p in prompts:  # every row of a prompt on one side
        assert len({side for side, part in split.items() for r in part if r["q"] == p}) == 1
    assert [r["i"] for r in split["train"]] == sorted(r["i"] for r in split["train"])  # the source's order
    shuffled = random.Random(0).sample(data, len(data))  # the ranking ignores row order and the other rows
    again = hash_holdout(shuffled, lambda r: r["q"], {"validation": 5, "test": 1}, seed=42)
    assert {r["q"] for r in again["validation"]} == set(ranked[:2])
    assert hash_holdout(data, lambda r: r["q"], {"validation": 1000}, seed=42)["validation"][0]["q"] == ranked[0]
    other = hash_holdout(data, lambda r: r["q"], {"validation": 0.04}, seed=7)  # round(0.04 x 25) = 1
    assert {r["q"] for r in other["validation"]} == {
        min(prompts, key=lambda p: hashlib.sha256(f"7\n{p}".encode()).hexdigest())
    }


def test_countdown_prompts_answers_and_holdout():
    task = Countdown(path=str(F / "countdown.jsonl"))
    source = rows("countdown.jsonl")
    train, validation = task.examples("train"), task.examples("validation")
    assert len(train) + len(validation) == 20 and len(validation) >= 1  # 19 distinct prompts: floor(1.9) = 1 held out
    first = next(e for e in train + validation if e.metadata["nums"] == source[0]["nums"])
    user = COUNTDOWN_TEMPLATE.replace("{nums}", str(source[0]["nums"])).replace("{target}", str(source[0]["target"]))
    assert first.prompt == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    assert user.startswith("Using the numbers [81, 75, 9, 78], create an equation that equals 69. Use only +, -, *")
    assert (first.answer, first.difficulty) == ("69", 4)
    repeated = [e for e in train + validation if e.metadata["nums"] == source[0]["nums"]]
    assert len(repeated) == 2 and (repeated[0] in validation) == (repeated[1] in validation)  # the repeat: one side
    completions = ["<think>156 - 87</think><answer>(81 + 75) - (9 + 78)</answer>", "<answer>81 + 75 + 9 + 78</answer>",
                   "<answer>(81 - 75) * 9 + 78 - 63</answer>"]  # fmt: skip
    result = task.score([first] * 3, completions)  # right; 243; 63 is not given
    assert result.total.tolist() == [1.0, 0.0, 0.0] and result.success.tolist() == [True, False, False]


def test_countdown_gold_rewards_similarity_to_the_verified_solution_and_succeeds_by_the_verifier():
    task = CountdownGold(path=str(F / "countdown_gold.jsonl"), validation_size=0)
    examples, source = task.examples("train"), rows("countdown_gold.jsonl")
    assert [e.prompt for e in examples] == [r["messages"][:2] for r in source]  # the same prompts as Countdown's
    references = [r["messages"][-1]["content"] for r in source]
    assert [e.metadata["reference"] for e in examples] == references
    # the authors compare final texts on both sides (issue 32): a verified solution, or its bare expression, scores 1
    result = task.score(examples[:1] * 3, [references[0], "((58) - 11) - 8", "<think>x</think> ((58) - 11) - 8"])
    assert result.total.tolist() == [1.0, 1.0, 1.0] and result.success.tolist() == [True, True, True]
    # restating the reasoning without the answer ranks below the answer (it outranked it against the whole message):
    # try combining 58 11 8 in order 58 11 8 39 (11 words) against 58 11 8: overlap 3, LCS 3 -> 2 x 3 / 14 = 3/7
    restated = "Try combining 58, 11, 8 in order: ((58) - 11) - 8 = 39."
    assert task.reward(examples[:1] * 2, [restated, "((58) - 11) - 8"]).tolist() == pytest.approx([3 / 7, 1.0])
    # reference_final_text=False compares with the whole message (before issue 32): the exact answer then scored
    # 6/19 (the message's words: think try combining 58 11 8 in order 58 11 8 39 think answer58 11 8answer, 16;
    # the answer's: 58 11 8, 3: overlap 3, LCS 3 -> F1 = ROUGE-L = 2 x 3 / (3 + 16))
    whole = CountdownGold(path=str(F / "countdown_gold.jsonl"), validation_size=0,
                          reward=WordSimilarity(reference_final_text=False))  # fmt: skip
    assert whole.reward(examples[:1], ["((58) - 11) - 8"]).item() == pytest.approx(6 / 19)
    result = task.score(examples, references)
    assert result.total.tolist() == [1.0] * 10 and result.success.all()
    bad = [r.replace("<answer>", "<answer>1 + ") for r in references]
    result = task.score(examples, bad)
    assert (result.total < 1).all() and (result.total > 0.5).all() and not result.success.any()


def test_openthoughts_prompt_reward_and_success():
    task = OpenThoughts(path=str(F / "openthoughts.jsonl"))
    examples = task.examples("train") + task.examples("validation")
    assert len(task.examples("validation")) == 1  # floor(10 % of 10)
    source = {r["conversations"][0]["value"]: r for r in rows("openthoughts.jsonl")}
    example = next(e for e in examples if e.prompt[-1]["content"] == "What is 12 times 7?")
    assert example.prompt[0] == {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT}
    assert OPENTHOUGHTS_SYSTEM_PROMPT.endswith(
        "answer. Put your reasoning in <think> </think> tags, followed by your final answer."
    )
    reference = source["What is 12 times 7?"]["conversations"][1]["value"]
    assert example.answer == reference and example.difficulty == 1 and example.metadata["domain"] == "math"
    # the reference's own text: format 1 and similarity 1 (its final text against the reference's final text, "The
    # product is **84**.", as the authors compare them: issue 32); the answer alone: similarity 1, format 0
    result = task.score([example] * 3, [reference, "The product is 84.", "<think>12 * 7</think>"])
    assert result.total.tolist() == pytest.approx([1.0, 0.65, 0.0])
    assert result.parts["format"].tolist() == [1.0, 0.0, 0.0]
    assert result.success.tolist() == [True, True, False]  # the training reward >= 0.5
    assert task.successes([example] * 3, [reference, "The product is 84.", ""]).tolist() == [True, True, False]
    # reference_final_text=False (before issue 32) compares with the whole turn (think 12 7 84 think product is 84,
    # 8 words): the answer's 3 words overlap 3, LCS 3 -> 6/11, and a perfect completion scored 0.35 + 0.65 x 6/11
    whole = WordSimilarity(reference_final_text=False)
    assert whole([example] * 2, [reference, "the product is 84"]).tolist() == pytest.approx([6 / 11, 6 / 11])


def test_polaris_evaluates_on_aime25_and_math500_without_their_problems_in_train():
    sets = {"aime25": str(F / "aime25.jsonl"), "math500": str(F / "math500.jsonl")}
    task = Polaris(path=str(F / "polaris.jsonl"), evaluation_sets=sets)
    train, validation = task.examples("train"), task.examples("validation")
    assert len(train) == 5  # 8 rows less the AIME one, the MATH-500 one and its whitespace variant
    problems = {e.metadata["question"] for e in train}
    assert not problems & {e.metadata["question"] for e in validation}
    assert [task.evaluation_set(e) for e in validation] == ["aime25"] * 3 + ["math500"] * 3  # val/<set>/accuracy
    assert [e.difficulty for e in validation] == ["aime25"] * 3 + [2, 1, 1]  # MATH-500's level, else the set
    assert {task.evaluation_set(e) for e in train} == {""}
    assert task.examples("test") == validation
    first = train[0]
    assert first.prompt == [{"role": "user", "content": "What is $1+2+\\cdots+10$?\nPlease reason step by step, and "
                                                           "put your final answer within \\boxed{}."}]  # fmt: skip
    assert first.metadata["pass_rate"] == "8/8" and first.answer == "55"
    completions = ["The sum is 55.", "<think>n(n+1)/2</think> \\boxed{55}", "<think>hmm</think> 56"]
    assert task.reward([first] * 3, completions).tolist() == [1.0, 1.0, 0.0]
    math500 = validation[3]
    assert task.successes([math500], ["$\\left(3, \\frac{\\pi}{2}\\right)$"]).tolist() == [True]


def test_gsm8k_similarity_variant_and_official_test_as_validation():
    task = GSM8K(path=str(F / "gsm8k.jsonl"), test_size=2, validate_on_test=True, system_prompt=SYSTEM_PROMPT,
                 reward=WordSimilarity(reference="solution"), verifier=final_text_verifier(workers=0))  # fmt: skip
    assert task.examples("validation") == task.examples("test") and len(task.examples("train")) == 3
    example = task.examples("train")[0]
    assert example.prompt[0]["content"] == SYSTEM_PROMPT
    assert example.prompt[1]["content"].endswith(
        "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    solution = example.metadata["solution"]
    result = task.score([example] * 2, [solution, f"The answer is {example.answer}."])
    assert result.total[0].item() == pytest.approx(1.0) and 0 < result.total[1].item() < 0.5
    assert result.success.tolist() == [True, True]  # the verifier on the final text: "#### 27" and "27." both


def test_deepmath_similarity_variant_hash_holdout_and_paper_prompt():
    task = DeepMath(path=str(F / "deepmath.jsonl"), validation_size=1000, seed=42, holdout="hash",
                    system_prompt=SYSTEM_PROMPT, template=MATH_TEMPLATE, reference_solutions=True,
                    reward=WordSimilarity(), verifier=final_text_verifier(workers=0))  # fmt: skip
    assert len(task.examples("train")) == 5 and task.examples("validation") == []  # min(1000, floor(0.5)) = 0
    example, row = task.examples("train")[0], rows("deepmath.jsonl")[0]
    assert (
        example.prompt[1]["content"]
        == row["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    # the shortest final text of r1_solution_1..3: "\boxed{-\frac{9}{2}}" (r1_solution_2) by characters
    assert example.metadata["reference"] == final_text(row["r1_solution_2"]) == "\\boxed{-\\frac{9}{2}}"
    result = task.score([example] * 2, [row["r1_solution_2"], "The limit is -4.5"])
    assert result.total.tolist() == pytest.approx([1.0, 0.0]) and result.success.tolist() == [True, True]
    with pytest.raises(ValueError, match="reference_solutions needs the columns"):
        DeepMath(path=str(F / "deepmath_trl_test.jsonl"), validation_size=0, reference_solutions=True).examples("train")


@pytest.mark.parametrize(
    ("task", "row", "needle"),
    [
        (Countdown, {"target": "24", "nums": [1, 2]}, "line 1, column 'target': is not an integer"),
        (Countdown, {"target": 24, "nums": []}, "line 1, column 'nums': is not a non-empty list"),
        (OpenThoughts, {"conversations": [{"from": "human", "value": "q"}]}, "line 1, .*holds no 'gpt' turn"),
        (Polaris, {"problem": "q", "answer": ""}, "line 1, column 'answer': is empty"),
    ],
)
def test_bad_rows_fail_at_load_naming_file_row_and_column(task, row, needle, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    extra = {"evaluation_sets": {"aime25": str(F / "aime25.jsonl")}} if task is Polaris else {}
    with pytest.raises(ValueError, match=needle):
        task(path=str(path), **extra).examples("train")


def test_example_metadata_reaches_reward_functions():
    example = Countdown(path=str(F / "countdown.jsonl")).examples("train")[0]
    assert isinstance(example, Example) and example.metadata["nums"] == [int(n) for n in example.metadata["nums"]]


def test_a_missing_value_is_neither_an_integer_nor_an_answer():
    """pandas writes a missing integer as NaN: Countdown's target and nums checks refused NaN without naming the file,
    row or column (``int(nan)`` raised inside the check) and infinity with a traceback (OverflowError); Polaris and
    the evaluation sets took a NaN answer as the gold answer "nan"."""
    from tasks.countdown import integer_problem, numbers_problem
    from tasks.polaris import answer_problem

    for value in (float("nan"), float("inf"), 2.5, "24", True):
        assert integer_problem(value).startswith("is not an integer"), value
    assert integer_problem(24) == integer_problem(24.0) == ""
    assert numbers_problem([1, float("nan")]) == "holds nan, not an integer"
    assert answer_problem(float("nan")) and answer_problem(float("-inf"))
    assert answer_problem(17) == answer_problem(17.0) == answer_problem("x") == ""
