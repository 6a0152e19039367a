"""The SoftmaxGRPO paper's rewards (issue 23) on a corpus of completions, each case checked against the
definition by hand: the final-text rule, the math verifier, the Countdown verifier, word similarity, format."""

import pytest
import torch

from sgrpo.types import Example
from tasks import CountdownReward, ThinkFormat, WordSimilarity, final_text, final_text_verifier, grade_countdown
from tasks.arithmetic import evaluate
from tasks.similarity import normalize_words, word_f1, word_rouge_l
from tasks.think_format import think_format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("plain answer", "plain answer"),  # no </think>: the whole completion
        ("<think>a</think> b ", "b"),
        ("<think>a</think>x</think>y", "y"),  # the LAST </think>
        ("<think>cut off while thinking", "<think>cut off while thinking"),  # open think: the whole completion
        ("<answer>5</answer>", "5"),
        ("<think><answer>1</answer></think> <answer>2</answer> and <answer> 3 </answer>", "3"),  # the last one
        ("<think>x</think> <answer>unclosed", "<answer>unclosed"),  # no complete answer block
        ("<answer>4</answer> then <answer>5", "4"),  # the last COMPLETE block
        ("<think><answer>1</answer></think> no tags here", "no tags here"),  # tags inside the thought do not count
        ("<answer>a<answer>b</answer>", "a<answer>b"),  # blocks read left to right, as the authors' findall reads
        ("<answer>a</answer> x </answer>", "a"),
        ("<think>t</think> 42<|im_end|><|endoftext|>", "42"),  # end-of-turn markers removed
    ],
)
def test_final_text(completion, expected):
    assert final_text(completion) == expected


MATH = [  # (gold, completion, reward)
    ("4", "\\boxed{4}", 1.0),
    ("4", "The answer is 4.", 1.0),  # no box required
    ("4", "<think>maybe \\boxed{5}</think> The answer is 4", 1.0),  # the draft in the thought is not graded
    ("4", "<think>I guess 4</think> It is 5.", 0.0),
    ("4", "<think>open, never closed: \\boxed{4}", 1.0),  # no </think>: the whole completion is the final text
    ("4", "<think>x</think><answer>\\frac{8}{2}</answer>", 1.0),
    ("4", "<think>x</think>The answer is 4, I mean <answer>3</answer>", 0.0),  # the <answer> content is graded
    ("\\frac{1}{2}", "It is 0.5", 1.0),
    ("x^2 + 1", "$x^2+1$", 1.0),
    ("504", "there are 505 such elements", 0.0),
]


def test_math_verifier_grades_the_final_text_boxed_or_not():
    reward = final_text_verifier(workers=0)
    examples = [Example("q", gold) for gold, _, _ in MATH]
    result = reward.score(examples, [completion for _, completion, _ in MATH])
    assert result.total.tolist() == [value for _, _, value in MATH] and result.failures == 0


NUMS, TARGET = [2, 3, 4], 24
COUNTDOWN = [  # (completion, numbers, target, label): the authors' rules; reward 1 exactly when "correct"
    ("2*3*4", NUMS, TARGET, "correct"),
    ("<think>2*3=6, 6*4=24</think>\n<answer>(2 * 3) * 4</answer>", NUMS, TARGET, "correct"),
    ("So \\boxed{4*3*2} or maybe \\boxed{1}", NUMS, TARGET, "correct"),  # the FIRST box
    ("\\boxed{\\frac{24}{1}} then \\boxed{2*3*4}", NUMS, TARGET, "correct"),  # the first box without braces inside
    ("`2*3*4`", NUMS, TARGET, "correct"),  # backticks at the ends stripped
    ("`2*3*4`.", NUMS, TARGET, "unparsed"),  # ... before the period goes: the closing backtick stays
    ("$2*3*4$", NUMS, TARGET, "correct"),
    ("$$2*3*4$$", NUMS, TARGET, "correct"),  # every $ at the ends
    ("2*3*4...", NUMS, TARGET, "correct"),  # every trailing period
    ("2*$3$*4", NUMS, TARGET, "unparsed"),  # $ inside stays
    ("2 × 3 × 4", NUMS, TARGET, "correct"),  # × read as *
    ("48 ÷ 2 ÷ 3 × 4 − 2 × 3 × 4 + 2 × 3 × 4", [48, 2, 3, 4, 2, 3, 4, 2, 3, 4], 32, "correct"),  # ÷ and − too
    ("2*3*4 = 24", NUMS, TARGET, "correct"),
    ("2*3*4 = 24.0", NUMS, TARGET, "correct"),  # Fraction("24.0")
    ("2*3*4 = 48/2", NUMS, TARGET, "correct"),  # Fraction("48/2")
    ("2*3*4 = 2.4e1", NUMS, TARGET, "correct"),  # Fraction("2.4e1")
    ("2*3*4 = 4.8 / 0.2", NUMS, TARGET, "equals"),  # no decimal division: Fraction refuses it
    ("2*3*4 = 24/0", NUMS, TARGET, "equals"),
    ("2*3*4 = 25", NUMS, TARGET, "equals"),
    ("2*3*4 = 24 = 24", NUMS, TARGET, "equals"),  # more than one =
    ("24 = 2*3*4", NUMS, TARGET, "equals"),  # the right side is no Fraction
    ("-2+3*4", NUMS, 10, "unparsed"),  # no unary sign
    ("+2*3*4", NUMS, TARGET, "unparsed"),
    ("2*3*-4+48", [2, 3, 4, 48], 24, "unparsed"),
    ("02*3*4", NUMS, TARGET, "unparsed"),  # no leading zeros (Python's literal)
    ("8/(3-8/3)", [3, 3, 8, 8], 24, "correct"),  # exact: in floats 8/(3-8/3) = 23.999999999999993
    ("5*(5-1/5)", [5, 5, 1, 5], 24, "correct"),  # a number given twice is used twice
    ("1000000 - 999976", [1000000, 999976], 24, "correct"),  # literals up to 10**6
    ("1000001 - 999977", [1000001, 999977], 24, "unparsed"),
    ("(" * 125 + "2*3*4" + ")" * 125, NUMS, TARGET, "correct"),  # 255 characters
    ("(" * 126 + "2*3*4" + ")" * 126, NUMS, TARGET, "too_long"),  # 257 characters
    ("2*3*4*1", NUMS, TARGET, "numbers"),  # 1 is not given
    ("2*3*3", NUMS, 18, "numbers"),  # 3 reused, 4 missing
    ("2*12", NUMS, TARGET, "numbers"),  # 12 is not given
    ("(2+4)*3", NUMS, TARGET, "wrong"),  # every number once, but 18
    ("(2+4)+3", [4, 3, 2], 9, "correct"),  # the order of the numbers is free
    ("4/(2-2)*3", NUMS, TARGET, "division_by_zero"),
    ("2 \\times 3 \\times 4", NUMS, TARGET, "unparsed"),
    ("2**3*4", NUMS, TARGET, "unparsed"),
    ("2^3*4", NUMS, TARGET, "unparsed"),
    ("2.0*3*4", NUMS, TARGET, "unparsed"),  # only integers on the left
    ("2(3*4)", NUMS, TARGET, "unparsed"),  # no implicit product
    ("(2*3*4", NUMS, TARGET, "unparsed"),
    ("__import__('os').system('true')", NUMS, TARGET, "unparsed"),  # parsed, never executed
    ("\u0662*\u0663*\u0664", NUMS, TARGET, "unparsed"),  # Arabic-Indic digits are no integers here
    ("<answer></answer>", NUMS, TARGET, "empty"),
]
#: the 13 of these 46 probes the verifier before issue 32 graded otherwise (checked against that code): the first
#: brace-free box, "`2*3*4`.", "2*3*4...", "2*$3$*4", the three ×/÷/− probes, "= 2.4e1", "= 4.8 / 0.2", the three
#: unary signs, "02", 1000001


@pytest.mark.parametrize(("completion", "numbers", "target", "label"), COUNTDOWN)
def test_countdown_verifier(completion, numbers, target, label):
    assert grade_countdown(completion, numbers, target) == (float(label == "correct"), label)


def test_countdown_reward_reads_the_example():
    examples = [Example("p", str(t), metadata={"nums": n}) for _, n, t, _ in COUNTDOWN]
    result = CountdownReward().score(examples, [c for c, _, _, _ in COUNTDOWN])
    assert result.total.tolist() == [float(label == "correct") for *_, label in COUNTDOWN]
    assert result.counts["correct"] == 19 and result.counts["unparsed"] == 15 and result.failures == 0


def test_expression_parser():
    from fractions import Fraction

    assert evaluate("8 / (3 - 8 / 3)") == (Fraction(24), [8, 3, 8, 3])
    assert evaluate(" (1 + 4) * 2 ") == (Fraction(10), [1, 4, 2])
    for bad in ("-(1 - 4) * 2", "1 if 2 else 3", "True + 1", "[1]", "x"):
        with pytest.raises((SyntaxError, ValueError)):
            evaluate(bad)


SIMILARITY = [  # (completion, reference, F1, ROUGE-L F1) computed by hand over the normalised words
    ("The cat sat on the mat.", "A cat sat on a mat", 1.0, 1.0),  # [cat sat on mat] both
    ("the cat sat", "cat on mat", 2 * 1 / 5, 2 * 1 / 5),  # overlap 1 of 2 and 3 words; LCS 1
    ("x y z w", "w z y x", 1.0, 2 * 1 / 8),  # the same multiset, LCS 1
    ("dog dog dog", "dog cat", 2 * 1 / 5, 2 * 1 / 5),  # multiset overlap min(3, 1) = 1
    ("x y z", "x z y w", 2 * 3 / 7, 2 * 2 / 7),  # overlap 3, LCS (x z) or (x y): 2
    ("Don't stop!", "dont, stop.", 1.0, 1.0),  # punctuation deleted: "dont stop"
    ("It costs $2.50.", "it costs 250", 1.0, 1.0),
    ("<think>cat cat cat</think> mat", "mat", 1.0, 1.0),  # the final text only
    ("<think>x</think>\n<answer>Cat sat</answer> ramble", "the cat sat", 1.0, 1.0),
    ("<think>mat", "mat", 0.0, 0.0),  # open think: the final text is "<think>mat" -> the word "thinkmat"
    ("The a an", "cat", 0.0, 0.0),  # no words left: 0
    ("!!!", "cat", 0.0, 0.0),
    ("cat", "The.", 0.0, 0.0),  # an empty reference: 0
    ("", "cat", 0.0, 0.0),
]


def test_word_similarity_is_point6_f1_plus_point4_rouge_l():
    reward = WordSimilarity()
    examples = [Example("q", reference) for _, reference, _, _ in SIMILARITY]
    result = reward.score(examples, [completion for completion, *_ in SIMILARITY])
    expected = torch.tensor([0.6 * f1 + 0.4 * rouge for *_, f1, rouge in SIMILARITY])
    torch.testing.assert_close(result.total, expected)
    assert normalize_words("The cat's 2.5 mats, a dog.") == ["cats", "25", "mats", "dog"]
    assert normalize_words("The—cat a’s") == ["—cat", "’s"]  # "the" and "a" at word boundaries
    assert word_f1([], ["a"]) == word_rouge_l(["a"], []) == 0.0


def test_word_similarity_reference_sources():
    example = Example("q", "18", metadata={"solution": "She pays 18 dollars", "reference": "ignored here"})
    assert WordSimilarity(reference="solution").score_one(example, "she pays 18 dollars") == 1.0
    assert WordSimilarity().score_one(example, "ignored here") == 1.0  # metadata["reference"] first
    assert WordSimilarity().score_one(Example("q", "18"), "18") == 1.0  # else the answer
    missing = WordSimilarity(reference="nope").score([Example("q", "18")], ["18"])
    assert missing.total.tolist() == [0.0] and missing.failures == 1  # a misnamed key is counted, not silent


FORMAT = [
    ("<think>a</think>b", "ok"),
    ("  \n<think>a</think>\nb", "ok"),  # whitespace before <think>
    ("<think> \n</think>b", "empty_thought"),
    ("<think>a</think>  \n", "empty_answer"),
    ("x<think>a</think>b", "tags"),  # does not start with <think>
    ("<think>a</think>b</think>", "tags"),  # two </think>
    ("<think><think>a</think>b", "tags"),  # two <think>
    ("a</think>b", "tags"),
    ("<think>a", "tags"),  # never closed
    ("", "tags"),
]


def test_think_format_reads_a_completion_inside_the_block_the_template_opened():
    """A template that opens ``<think>`` in the prompt (R1-Distill's) leaves the tag out of every completion: each
    scored 0 ("tags"; found by a review). Adapted to such a tokenizer the reward reads the completion after it."""
    from sgrpo.model.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<think>\n{% endif %}")  # fmt: skip
    reward = ThinkFormat()
    assert reward.score([Example("q", "a")], ["a</think>b"]).total.item() == 0.0
    reward.adapt_to_tokenizer(tokenizer)
    completions = ["a</think>b", "a", "<think>a</think>b"]  # inside the block; never closed; a second <think>
    assert reward.score([Example("q", "a")] * 3, completions).total.tolist() == [1, 0, 0]


@pytest.mark.parametrize(("completion", "label"), FORMAT)
def test_think_format(completion, label):
    assert think_format(completion) == (float(label == "ok"), label)
    assert ThinkFormat().score([Example("q", "a")], [completion]).total.item() == float(label == "ok")
