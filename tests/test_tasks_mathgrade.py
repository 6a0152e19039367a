"""DeepMath grading rules through the public API, both ways: what must pass and what must still fail.

Every case goes through ``DeepMath(reward=MathVerifyReward(...))``: its reward, and its success test,
which must agree with the reward. The classes are those of issue 16: cut-off thinking, an answer after
``</think>`` without a box, several boxes, numbers in other notations, spellings of one set; and the
answers DeepMath's authors' reward wrongly accepts, which sgrpo must keep rejecting.
"""

import pytest

from sgrpo.model.tiny import build_char_tokenizer
from sgrpo.types import Example
from tasks import DeepMath, MathVerifyReward, WeightedSum

JSONL = "tests/fixtures/deepmath.jsonl"


def graded(gold: str, completion: str, **options) -> tuple[float, str]:
    """The reward (scale "01") and label of one completion; DeepMath's success test must agree with it."""
    task = DeepMath(path=JSONL, reward=MathVerifyReward(workers=0, **options))
    example = Example([{"role": "user", "content": "question"}], gold)
    result = task.reward.score([example], [completion])
    value, (label,) = result.total.item(), result.counts
    assert task.success(example, completion) == (value == 1.0), (gold, completion)
    return value, label


# ---------------------------------------------------------------- 1. cut-off thinking
R1_LIKE = (  # the R1-Distill layout: the generation prompt opens the think block
    "{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_OFF = CHATML.replace("assistant\\n{% endif %}", "assistant\\n<think>\\n\\n</think>\\n\\n{% endif %}")


def tokenizer_with(template: str | None):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Maybe 4? Then \\boxed{4}? Let me check the case n = 2 again", (0.0, "unclosed_think")),  # cut off
        ("<think>\nSo \\boxed{4}, but wait", (0.0, "unclosed_think")),
        ("The answer is \\boxed{4}.", (0.0, "unclosed_think")),  # an answer without the closing tag is none
        ("Try 4: it works.\n</think>\nThe answer is \\boxed{4}.", (1.0, "correct")),  # R1 layout: no opening tag
        ("<think>\nTry 4.\n</think>\n\\boxed{4}", (1.0, "correct")),
        ("Try \\boxed{4}.\n</think>\nThe answer is \\boxed{5}.", (0.0, "wrong")),  # the box after </think> counts
    ],
)
def test_require_think_grades_only_a_finished_thought(completion, expected):
    assert graded("4", completion, require_think=True) == expected


def test_without_require_think_an_untagged_answer_is_graded():
    # instruct models write no think tags: their box counts (the default until a template says otherwise)
    assert graded("4", "So the answer is \\boxed{4}.") == (1.0, "correct")
    assert graded("4", "<think>\nSo \\boxed{4}, but wait") == (0.0, "no_box")  # opened and never closed


def test_unclosed_think_scores_minus_one_on_the_authors_scale():
    reward = MathVerifyReward(require_think=True, scale="pm1", workers=0)
    result = reward.score([Example("q", "4")] * 2, ["\\boxed{4}", "x </think> \\boxed{4}"])
    assert result.total.tolist() == [-1.0, 1.0] and result.counts == {"unclosed_think": 1, "correct": 1}


@pytest.mark.parametrize(
    ("template", "opens"), [(R1_LIKE, True), (CHATML, False), (THINKING_OFF, False), (None, False)]
)
def test_require_think_follows_the_chat_template(template, opens):
    task = DeepMath(path=JSONL)
    assert task.reward.require_think is None and task.success_grader.require_think is None
    task.adapt_to_tokenizer(tokenizer_with(template))
    assert task.reward.require_think is opens and task.success_grader.require_think is opens  # reward and success
    cut_off = "Maybe \\boxed{504}? Let me check"
    assert graded("504", cut_off, require_think=task.reward.require_think)[0] == (0.0 if opens else 1.0)


def test_an_explicit_require_think_overrides_the_template():
    task = DeepMath(path=JSONL, reward=MathVerifyReward(require_think=False))
    task.adapt_to_tokenizer(tokenizer_with(R1_LIKE))
    assert task.reward.require_think is False and task.success_grader.require_think is False
    summed = WeightedSum([MathVerifyReward()])  # a combined reward passes the tokenizer on
    summed.adapt_to_tokenizer(tokenizer_with(R1_LIKE))
    assert summed.rewards[0].require_think is True


def test_the_policy_gives_the_task_its_tokenizer(tmp_path):
    from estimators import GRPO
    from sgrpo.model.tiny import ensure_tiny_model
    from sgrpo.policy import GRPOPolicy

    model_dir = ensure_tiny_model(tmp_path / "tiny")
    tokenizer_with(R1_LIKE).save_pretrained(model_dir)
    task = DeepMath(path=JSONL)
    GRPOPolicy(model=str(model_dir), task=task, estimator=GRPO()).configure_model()
    assert task.reward.require_think is True and task.success_grader.require_think is True


# ---------------------------------------------------------------- 2. an answer after </think> without a box
@pytest.mark.parametrize(
    ("gold", "completion", "expected"),
    [
        ("4", "<think>so \\boxed{4}</think>\nHence the answer is 4.", (1.0, "correct")),
        ("6\\sqrt{2}", "<think>so \\boxed{6\\sqrt2}</think>\n$6\\sqrt{2}$", (1.0, "correct")),
        ("4", "<think>so \\boxed{4}</think>\nHence the answer is 5.", (0.0, "wrong")),
        ("4", "<think>so \\boxed{4}</think>\n", (0.0, "unparsed")),  # a box inside the thinking is not the answer
        ("4", "<think>so \\boxed{4}</think>\nThe answer is \\boxed{5}, not 4.", (0.0, "wrong")),  # a box wins
    ],
)
def test_require_box_false_grades_the_text_after_think(gold, completion, expected):
    assert graded(gold, completion, require_box=False) == expected


def test_by_default_an_unboxed_answer_scores_zero():
    assert graded("4", "<think>so \\boxed{4}</think>\nHence the answer is 4.") == (0.0, "no_box")
    # why the box is the default: free text is read by its last number
    assert graded("3", "</think>\nWe need 3 steps, so 2 moves suffice.", require_box=False) == (0.0, "wrong")


# ---------------------------------------------------------------- 3. several boxes
@pytest.mark.parametrize(
    ("gold", "completion", "score"),
    [
        ("2, 3", "The roots are $\\boxed{2}$ and $\\boxed{3}$.", 1.0),
        ("2, 3", "$\\boxed{3}$ and $\\boxed{2}$", 1.0),
        ("2, 3", "\\boxed{2, 3}", 1.0),
        ("\\{2, 3\\}", "$x = \\boxed{2}$ or $x = \\boxed{3}$", 1.0),
        ("x = 1; y = -2", "\\boxed{x = 1} and \\boxed{y = -2}", 1.0),
        ("2, 3", "The roots are $\\boxed{2}$ and $3$.", 0.0),  # one part boxed
        ("2, 3", "$\\boxed{2}$, $\\boxed{3}$, $\\boxed{4}$", 0.0),  # one part too many
        ("2, 3", "<think>\\boxed{2}</think> so \\boxed{3}", 0.0),  # only boxes after </think> count
        ("(2, 3)", "$\\boxed{2}$ and $\\boxed{3}$", 0.0),  # a pair is one answer: the last box is graded
        ("1", "\\boxed{1} or maybe \\boxed{2}", 0.0),  # a single answer: the last box, as before
        ("2", "\\boxed{1}, no: \\boxed{2}", 1.0),
        ("1,000", "So $a=\\boxed{12}$ first; the total is \\boxed{1000}.", 1.0),  # thousands: one part (was 0)
        ("1,\\!000", "So $a=\\boxed{12}$ first; the total is \\boxed{1000}.", 1.0),
        ("5", "The answer is $\\boxed 5$. Check: $\\frac{10}{2} = 5$.", 1.0),  # the box's token, not a later brace
        ("10", "The answer is $\\boxed 5$. Check: $\\frac{10}{2} = 5$.", 0.0),
    ],
)
def test_several_boxes_are_graded_together_when_the_gold_has_several_parts(gold, completion, score):
    assert graded(gold, completion)[0] == score


# ---------------------------------------------------------------- 4. numbers in other notations
@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("120000", "1.2e5"),
        ("120000", "1.2E+5"),
        ("0.001", "1e-3"),
        ("602000000000000000000000", "6.02\\times10^{23}"),
        ("602000000000000000000000", "6.02 \\cdot 10^{23}"),
        ("602000000000000000000000", "6.02e23"),
        ("6.02 \\times 10^{23}", "602000000000000000000000"),
        ("6.02 \\times 10^{23}", "6.022\\times10^{23}"),  # within the gold's printed precision
        ("1.5\\times10^{-3}", "0.0015"),
        ("0.866", "\\frac{\\sqrt{3}}{2}"),  # a gold printed as a rounded decimal
        ("0.866", "0.86603"),
        ("-0.866", "-\\frac{\\sqrt{3}}{2}"),
        ("3.14", "\\pi"),
        ("0.333", "\\frac{1}{3}"),
        ("2e", "2e"),  # Euler's e stays e
        ("e^{2}", "e^2"),
    ],
)
def test_numbers_in_other_notations_are_read_as_meant(gold, answer):
    assert graded(gold, f"\\boxed{{{answer}}}") == (1.0, "correct")


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("120000", "1.2e4"),
        ("0.001", "1e-4"),
        ("602000000000000000000000", "6.0221\\times10^{23}"),  # an integer gold is exact
        ("6.02 \\times 10^{23}", "6.03\\times10^{23}"),
        ("0.866", "0.87"),  # never looser than the gold's precision
        ("0.866", "0.867"),
        ("0.866", "\\frac{\\sqrt{2}}{2}"),
        ("0.8660254", "0.866025"),  # 7 printed places: math-verify's 6 would accept it
        ("0.5", "0.54"),  # a short decimal is taken as exact: 0.45 to 0.55 would be too loose
        ("2.5", "2.46"),
        ("7", "2e"),  # 2e is not 2 * 10^something
    ],
)
def test_numbers_outside_the_gold_precision_still_fail(gold, answer):
    assert graded(gold, f"\\boxed{{{answer}}}") == (0.0, "wrong")


# ---------------------------------------------------------------- 5. spellings of one set
@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("\\mathbb{Z}", "\\mathbb Z"),
        ("\\mathbb{Z}", "\\mathbb{ Z }"),
        ("\\mathbb{R}", "\\mathbb R"),
        ("\\mathbb{Z}_2", "\\mathbb{Z}_{2}"),
        ("\\mathbb{Z}_{2}", "\\mathbb{Z}_2"),
        ("\\mathbb{Z}_2", "\\mathbb Z_2"),
        ("\\mathbb{Z}_2 \\times \\mathbb{Z}_2", "\\mathbb Z_{2}\\times\\mathbb Z_{2}"),
        ("\\mathbb{R} \\setminus \\{0\\}", "\\mathbb R\\setminus\\{0\\}"),
    ],
)
def test_spellings_of_one_set_match(gold, answer):
    assert graded(gold, f"\\boxed{{{answer}}}") == (1.0, "correct")


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("\\mathbb{Z}_2", "\\mathbb{Z}_3"),
        ("\\mathbb{Z}_2", "\\mathbb Z"),
        ("\\mathbb{Z}_2", "\\mathbb{Z}_{12}"),
        ("\\mathbb{Z}", "\\mathbb R"),
        ("\\mathbb{Z}_2", "\\mathbb{Z}_2 \\times \\mathbb{Z}_2"),
    ],
)
def test_other_sets_still_fail(gold, answer):
    assert graded(gold, f"\\boxed{{{answer}}}")[0] == 0.0


# ---------------------------------------------------------------- where DeepMath's authors' reward is wrong
@pytest.mark.parametrize(
    ("gold", "wrong", "right"),
    [
        ("4", "400", "4"),  # their percentage rule: 400 % ...
        ("4", "0.04", "4.0"),  # ... and 4 %
        ("\\frac{1}{3}", "0.3333", "\\frac{2}{6}"),  # their 1e-4 relative tolerance ...
        ("123456789012", "123456789013", "123456789012"),  # ... and off-by-one large integers
        ("10^{18}", "1000000000000000001", "1000000000000000000"),
        ("2^{2023}", "2^{2022}", "2 \\cdot 2^{2022}"),  # their float overflow
        ("(-\\infty, 2]", "(-\\infty, 2)", "(-\\infty,2]"),  # their stripped brackets
        ("[0, 1)", "[0, 1]", "[0,1)"),
        ("\\mathbb{Z}_2", "\\mathbb{Z}_3", "\\mathbb{Z}_{2}"),
    ],
)
def test_what_the_authors_reward_wrongly_accepts_is_rejected(gold, wrong, right):
    for options in ({}, {"require_think": True, "require_box": False}):  # sgrpo's default and authors' gate
        completion = "Thinking.\n</think>\nThe answer is \\boxed{{{}}}."
        assert graded(gold, completion.format(wrong), **options)[0] == 0.0, wrong
        assert graded(gold, completion.format(right), **options) == (1.0, "correct"), right
