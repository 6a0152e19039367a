"""Text-similarity rewards, Poetry (H1, H2), MeetingBank, GSM8K, the generic reference task, loaders."""

import json
from pathlib import Path

import pytest

from sgrpo.types import Example
from tasks import (
    GSM8K,
    Bleu,
    ChrF,
    EditSimilarity,
    ExactMatch,
    MathVerifyReward,
    MeetingBank,
    NumericMatch,
    PoetryClassification,
    PoetryWriting,
    ReferenceText,
    RougeL,
)
from tasks.data import SplitTable
from tasks.similarity import normalize_label, strip_think

FIXTURES = Path(__file__).parent / "fixtures"
POEMS = [json.loads(line) for line in (FIXTURES / "poetry.jsonl").read_text().splitlines()]
MEETINGS = [json.loads(line) for line in (FIXTURES / "meetingbank.jsonl").read_text().splitlines()]

METRICS = [ExactMatch(), ChrF(), ChrF(word_order=2), Bleu(), RougeL(), EditSimilarity(), EditSimilarity("indel")]


@pytest.mark.parametrize("metric", METRICS, ids=lambda m: f"{m.name}{getattr(m, 'word_order', '')}")
def test_every_metric_is_in_unit_range(metric):
    reference = MEETINGS[0]["summary"]
    example = Example("p", reference)
    completions = [reference, reference[: len(reference) // 2], "completely unrelated words here", "", "   "]
    values = metric([example] * 5, completions).tolist()
    assert values[0] == pytest.approx(1.0)  # identical text
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values[3] == values[4] == 0.0  # empty answers score 0
    if not isinstance(metric, ExactMatch):
        assert 0.0 < values[1] < 1.0 and values[2] < values[1]  # partial overlap in between


def test_think_block_and_label_normalisation():
    assert strip_think("<think>Love? no</think> Nature") == " Nature"
    assert strip_think("<think>still thinking") == "" and strip_think("plain") == "plain"
    assert normalize_label("Answer: Mythology & Folklore.") == "mythology and folklore"
    assert normalize_label("  LOVE!  ") == "love"
    reward = ChrF(normalize=True)
    example = Example("p", "Mythology & Folklore")
    assert reward([example], ["<think>hmm</think>answer: mythology and folklore"]).tolist() == [1.0]


def test_poetry_classification_h1():
    task = PoetryClassification(path=str(FIXTURES / "poetry.jsonl"), validation_size=1, test_size=1)
    examples = [e for s in ("train", "validation", "test") for e in task.examples(s)]
    assert sorted(e.answer for e in examples) == sorted(p["type"] for p in POEMS)
    assert task.choices == ["Love", "Mythology & Folklore", "Nature"]
    text = examples[0].prompt[0]["content"]
    assert "Answer with exactly one of: Love, Mythology & Folklore, Nature." in text and text.endswith("Answer:")
    love = Example("p", "Love")
    completions = ["Love", "answer: love.", "Nature", "Lovely", ""]
    rewards = task.reward([love] * 5, completions).tolist()
    assert rewards[:2] == [1.0, 1.0] and rewards[2] < 0.1 and 0.3 < rewards[3] < 1.0 and rewards[4] == 0.0
    assert task.successes([love] * 5, completions).tolist() == [True, True, False, False, False]
    age = PoetryClassification(path=str(FIXTURES / "poetry.csv"), label="age", validation_size=0, test_size=0)
    assert age.choices is None and {e.answer for e in age.examples("train")} == {"Modern", "Renaissance"}
    assert age.choices == ["Modern", "Renaissance"]


def test_poetry_writing_h2_from_csv():
    task = PoetryWriting(path=str(FIXTURES / "poetry.csv"), validation_size=0, test_size=0, chat=False)
    first = task.examples("train")[0]
    assert first.prompt == 'Write the poem "The Winter Drawer" by EDITH MARLOWE.'
    assert first.answer == POEMS[0]["content"]  # the csv keeps the poem's newlines
    half = "\n".join(first.answer.splitlines()[:2])
    rewards = task.reward([first] * 3, [first.answer, half, POEMS[1]["content"]]).tolist()
    assert rewards[0] == 1.0 and rewards[2] < rewards[1] < 1.0
    assert task.successes([first] * 2, [first.answer, POEMS[1]["content"]]).tolist() == [True, False]


def test_poetry_splits_are_deterministic_and_disjoint():
    def titles(seed):
        task = PoetryWriting(path=str(FIXTURES / "poetry.jsonl"), validation_size=0.2, test_size=0.2, seed=seed)
        return {s: [e.prompt[0]["content"] for e in task.examples(s)] for s in ("train", "validation", "test")}

    a = titles(0)
    assert a == titles(0) and [len(v) for v in a.values()] == [3, 1, 1]
    assert len(set(sum(a.values(), []))) == 5


def test_meetingbank_truncation_and_rouge_reward():
    task = MeetingBank(path=str(FIXTURES / "meetingbank.jsonl"), max_transcript_tokens=20, test_size=1)
    example = task.examples("test")[0]
    transcript = example.prompt[0]["content"].split("Transcript:\n")[1].split("\n\nSummary:")[0]
    assert len(transcript.split()) == 15 and example.metadata["truncated"]  # 20 tokens * 0.75 words
    assert example.metadata["uid"] in {m["uid"] for m in MEETINGS}
    full = MeetingBank(path=str(FIXTURES / "meetingbank.jsonl"), max_transcript_tokens=None)
    assert not full.examples("train")[0].metadata["truncated"]
    reference = example.answer
    rewards = task.reward([example] * 3, [reference, " ".join(reference.split()[:8]), "Motion carries."])
    assert rewards[0] == 1.0 and rewards[2] < rewards[1] < 1.0
    assert task.successes([example] * 2, [reference, "Motion carries."]).tolist() == [True, False]


def test_gsm8k_answers_rewards_and_success():
    task = GSM8K(path=str(FIXTURES / "gsm8k.jsonl"), validation_size=1, test_size=1)
    examples = [e for s in ("train", "validation", "test") for e in task.examples(s)]
    assert sorted(e.answer for e in examples) == sorted(["27", "140", "250", "516", "1710"])
    assert {e.difficulty for e in examples} == {2, 3, 4}  # reasoning lines before ####
    content = examples[0].prompt[0]["content"]
    assert content.endswith("put your final answer within \\boxed{}.")
    ex = Example("q", "1710")
    completions = ["\\boxed{1,710}", "so 1710 plants.", "\\boxed{1710.0}", "\\boxed{171}", "no idea", "$1,710"]
    assert task.reward([ex] * 6, completions).tolist() == [1, 1, 1, 0, 0, 1]
    assert task.successes([ex] * 2, ["\\boxed{1710}", "1709"]).tolist() == [True, False]
    math_verify = MathVerifyReward(require_box=False, workers=0)
    assert math_verify([Example("q", "18")], ["The answer is 18 dollars"]).tolist() == [1.0]
    assert NumericMatch().score([ex], ["no number"]).counts == {"no_number": 1}


@pytest.mark.parametrize(("gold", "completion", "expected"), [
    ("2", "\\boxed{\\frac{1}{2}}", 0.0),  # before: the box's last number, 2
    ("10", "\\boxed{2^{10}}", 0.0),
    ("25", "\\boxed{.25}", 0.0),  # before: .25 read as 25
    ("5", "\\boxed{-.5}", 0.0),
    ("12", "x = 12.5, so the answer is \\boxed{12", 0.0),  # a box cut off: no answer (before: the text's 12)
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("0.75", "\\boxed{3/4}", 1.0),
    ("12", "\\boxed{12 \\text{ apples}}", 1.0),
    ("12", "\\boxed{x = 12}.", 1.0),
    ("1000", "\\boxed{1{,}000}", 1.0),
    ("18", "\\boxed{\\$18}", 1.0),
    ("5", "The answer is $\\boxed 5$. Check: $\\frac{10}{2} = 5$.", 1.0),  # before: the next brace, 10
    ("18", "\\boxed\n{18}", 1.0),
    ("18", "\\boxed{18^\\circ}", 1.0),  # what holds no number around it: as the box's last number read it
    ("60", "\\boxed{60 \\text{ km/h}}", 1.0),
    ("18", "\\boxed{\\mathbf{18}}", 1.0),
    ("18", "\\boxed{18~\\text{dollars}}", 1.0),
    ("18", "\\boxed{\\displaystyle {18}}", 1.0),
    ("18", "\\boxed{+18 \\text{ (dollars)}}", 1.0),
    ("18", "\\boxed{\\text{Total cost} = 18}", 1.0),
    ("36", "\\boxed{36 \\text{ cm}^2}", 1.0),  # before: its last number, 2
    ("56", "\\boxed{5, 6}", 0.0),  # two numbers
    ("1000", "\\boxed{1\\!000}", 1.0),
    *[(gold, f"\\boxed{{{box}}}", 0.0) for gold, box in (  # expressions: no number (the lenient reading took them)
        ("18", "{18}^2"), ("3", "3e^2"), ("5", "5\\pi"), ("50", "50 - x"), ("18", "x != 18"), ("18", "18!"),
        ("20", "20/x"), ("12", "12 \\cdot n"), ("18", "\\sqrt{x} = 18"), ("18", "-x = 18"),
        ("5", "5 \\times \\text{rate}"))],
])  # fmt: skip
def test_numeric_match_reads_the_box_as_one_number(gold, completion, expected):
    """GSM8K's default reward and success test (``NumericMatch``): the last box read as one number, not its last
    number; a box cut at the token cap holds no answer."""
    assert NumericMatch().score([Example("q", gold)], [completion]).total.tolist() == [expected]


@pytest.mark.parametrize(("gold", "completion", "expected"), [
    ("4", "It takes between 3-4 hours.", 1.0),  # before: -4 (a range's dash read as a sign)
    ("7", "10-3=7", 1.0),
    ("-4", "so x = -4", 1.0),
    ("-4", "The change is (-4).", 1.0),
    ("1500", "about 1.5e3 grams", 1.0),  # before: 3 (the exponent read as the last number)
    ("0.05", "costs 5e-2 dollars", 1.0),
    ("-5", "The vertex is (2,-5)", 1.0),  # a separating comma is no digit group: not the range 2-5
    ("-3", "the roots are 1,-3", 1.0),
    ("-3", "so $x \\approx-3$", 1.0),  # a minus after a LaTeX command is a sign
    ("1000", "It costs $1,000.", 1.0),  # a comma between digits groups them
    ("5", "the list 3,-4,5", 1.0),  # a comma before one digit separates
    ("1000000", "1,000,000 of them", 1.0),
    ("3", "so $\\pi-3$", 1.0),  # a difference: \\pi is no relation
    ("18", "The answer is \u221218.", 0.0),  # U+2212, typeset text's minus sign: -18 (before: 18, right)
    ("-18", "The answer is \u221218.", 1.0),
    ("-18", "\\boxed{\u221218}", 1.0),  # before: no number
])  # fmt: skip
def test_numeric_match_reads_unboxed_text_s_last_number_with_its_sign_and_exponent(gold, completion, expected):
    assert NumericMatch().score([Example("q", gold)], [completion]).total.tolist() == [expected]


def test_generic_reference_text(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"say {w}", "a": w}) for w in ["red", "green", "blue", "gold"]))
    task = ReferenceText(str(data), prompt_field="q", reference_field="a", validation_size=1, test_size=0)
    assert len(task.examples("train")) == 3 and len(task.examples("validation")) == 1
    ex = task.examples("train")[0]
    assert ex.prompt == [{"role": "user", "content": f"say {ex.answer}"}]
    with pytest.raises(ValueError, match=r"line 1, column 'a': missing; the source has columns \['answer', 'q'\]"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"q": "x", "answer": "y"}))
        ReferenceText(str(bad), prompt_field="q", reference_field="a", validation_size=0, test_size=0).examples("train")


def test_folder_of_split_files_uses_native_splits(tmp_path):
    for split, rows in (("train", POEMS[:3]), ("test", POEMS[3:])):
        (tmp_path / f"{split}-00000-of-00001.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = SplitTable(str(tmp_path), sizes={"validation": 1})
    assert table.splits() == ["test", "train", "validation"]
    assert len(table.rows("train")) == 2 and len(table.rows("test")) == 2 and len(table.rows("validation")) == 1


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; give a local"):
        MeetingBank(path="no/such/file.json")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        SplitTable(str(tmp_path / "data.txt"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not a JSON object per line"):
        SplitTable(str(broken)).rows("train")
    with pytest.raises(ValueError, match="success_threshold must be in"):
        PoetryWriting(path=str(FIXTURES / "poetry.jsonl"), success_threshold=0)
    with pytest.raises(ValueError, match=r"template must contain the placeholder\(s\) \{question\}"):
        GSM8K(path=str(FIXTURES / "gsm8k.jsonl"), template="no placeholder")
    with pytest.raises(ValueError, match="has no 'test' split"):
        GSM8K(path=str(FIXTURES / "gsm8k.jsonl")).examples("test")
