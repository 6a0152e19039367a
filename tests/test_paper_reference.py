"""Every paper config against an independent reference of the authors' rewards, prompts and holdouts (issue 32).

tests/paper_reference.py re-implements the authors' rules (jeffhernandez1995/softmaxgrpo: rewards.py,
prepare_data.py) without sgrpo's code. Here each config in configs/paper/ is built as its YAML says, on files
generated in the hub datasets' schemas (Countdown-Tasks-3to4, Countdown-Task-GOLD, DeepMath-103K, GSM8K,
OpenThoughts3, Polaris / AIME 2025 / MATH-500), and must give exactly the reference's prompts, train / validation
prompts (the holdout) and, for several hundred deterministically varied completions, its reward and success.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from pathlib import Path

import pytest
import yaml

from tests import paper_reference as ref

PAPER = Path(__file__).resolve().parents[1] / "configs" / "paper"


def build(node, overrides: dict | None = None):
    """Instantiate a ``{class_path, init_args}`` tree as the config gives it (rewards graded in-process)."""
    if isinstance(node, dict) and "class_path" in node:
        module, name = node["class_path"].rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        args = {key: build(value) for key, value in (node.get("init_args") or {}).items()}
        if "workers" in args or "workers" in inspect.signature(cls).parameters:
            args["workers"] = 0
        return cls(**args | (overrides or {}))
    if isinstance(node, list):
        return [build(item) for item in node]
    if isinstance(node, dict):
        return {key: build(value) for key, value in node.items()}
    return node


def write(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---- source rows in the hub schemas ------------------------------------------------------------------------------

SHAPES = ["({a} + {b}) * {c}", "{a} * {b} - {c}", "{a} + {b} + {c}", "({a} - {b}) * {c} + {d}", "{a} * {b} / {c}"]


def countdown_problems(rng: random.Random, n: int) -> list[tuple[list[int], int, str]]:
    out = []
    while len(out) < n:
        shape = rng.choice(SHAPES)
        values = {k: rng.randint(1, 60) for k in "abcd" if "{" + k + "}" in shape}
        expression = shape.format(**values)
        value = eval(expression)  # noqa: S307 - the test's own arithmetic on its own integers
        if value != int(value) or value <= 0:
            continue
        nums = list(values.values())
        rng.shuffle(nums)
        out.append((nums, int(value), expression))
    return out


def math_rows(rng: random.Random, n: int) -> list[tuple[str, str]]:
    golds = [
        "4",
        "\\frac{1}{2}",
        "0.866",
        "2, 3",
        "1,710",
        "x^2 + 1",
        "\\sqrt{2}",
        "5",
        "-3",
        "\\pi",
        "12",
        "1.2e5",
        "\\mathbb{Z}",
        "(-\\infty, 2]",
        "Yes",
        "504",
    ]
    return [(f"  Question {i}: find it. ", rng.choice(golds)) for i in range(n)]


def math_completions(gold: str, rng: random.Random) -> list[str]:
    wrong = "7" if gold != "7" else "8"
    return [
        f"\\boxed{{{gold}}}",
        f"The answer is {gold}.",
        f"<think>maybe {wrong}</think> \\boxed{{{gold}}}",
        f"<think>maybe {gold}</think> It is {wrong}.",
        f"\\boxed{{{wrong}}} ... finally \\boxed{{{gold}}}",
        f"\\fbox{{{gold}}}",
        f"<answer>{gold}</answer>",
        f"<think>cut off \\boxed{{{gold}}}",
        f"$ {gold} $",
        f"\\boxed{{{gold}\\%}}",
        f"{gold}<|im_end|>",
        f"<answer>{wrong}</answer> <answer>\\boxed{{{gold}}}</answer>",
        rng.choice(
            [
                "\\boxed{0.866}",
                "\\boxed{\\frac{\\sqrt3}{2}}",
                "\\boxed{120000}",
                "\\boxed{\\mathbb Z}",
                "\\boxed{2} and \\boxed{3}",
                "\\boxed{1710}",
                "\\boxed{Yes}",
                "",
            ]
        ),
    ]


def countdown_completions(nums: list[int], target: int, expression: str, rng: random.Random) -> list[str]:
    unicode = expression.replace("*", "×").replace("/", "÷").replace("-", "−")
    other = expression.replace(str(nums[0]), str(nums[0] + 1), 1)
    return [
        f"<think>try</think><answer>{expression}</answer>",
        f"<answer>{expression} = {target}</answer>",
        f"<answer>{unicode}</answer>",
        f"\\boxed{{{expression}}}",
        f"$`{expression}`$.",
        f"`{expression}`.",
        f"{expression}...",
        f"<answer>{expression} = {target}.0</answer>",
        f"<answer>{expression} = {target * 2}/2</answer>",
        f"<answer>{expression} = {target + 1}</answer>",
        f"<answer>-{expression}</answer>",
        f"<answer>0{expression}</answer>",
        f"<answer>{other}</answer>",
        f"<answer>{expression} # done</answer>",
        f"<answer>{expression}\n= {target}</answer>",
        rng.choice(
            [f"<answer>({expression})*1</answer>", "<answer></answer>", f"{target}", f"{expression} = 4.8 / 0.2"]
        ),
    ]


def similarity_completions(reference: str, rng: random.Random) -> list[str]:
    answer = ref.final_text(reference)
    reasoning = reference.split("</think>")[0].replace("<think>", "")
    return [
        reference,
        answer,
        f"<think>{reasoning}</think>\n{answer}",
        f"<think>x</think><answer>{answer}</answer>",
        reasoning,
        f"The—answer is {answer.lower()}",
        " ".join(answer.split()[::-1]),
        f"<think>{answer}",
        f"<think>a</think><think>b</think>{answer}",
        f"<think> </think>{answer}",
        rng.choice(["", "the a an", f"{answer} {answer}", "unrelated words here"]),
    ]


# ---- the comparison ------------------------------------------------------------------------------------------


def check(task, train_refs: list[dict], validation_refs: list[dict], completions, rng, success: bool = True) -> int:
    """The task's prompts, splits, rewards and successes equal the reference's; returns the completions graded."""
    graded = 0
    for split, refs in (("train", train_refs), ("validation", validation_refs)):
        examples = list(task.examples(split))
        assert [e.prompt for e in examples] == [r["messages"] for r in refs], split
        pairs = [(e, r, text) for e, r in zip(examples, refs, strict=True) for text in completions(r, rng)]
        result = task.score([e for e, _, _ in pairs], [text for _, _, text in pairs])  # one batch: one grading
        expected = [ref.score(r["truth"], text) for _, r, text in pairs]
        for (_, _, text), got, want in zip(pairs, result.total.tolist(), expected, strict=True):
            assert got == pytest.approx(want["score"], abs=1e-6), (text, got, want)
        if success and "accuracy" in expected[0]:
            wanted = [w["accuracy"] == 1.0 for w in expected]
            mismatched = [text for (_, _, text), g, w in zip(pairs, result.success.tolist(), wanted) if g != w]
            assert not mismatched, mismatched[:5]
        graded += len(pairs)
    return graded


def config(name: str) -> dict:
    return yaml.safe_load((PAPER / f"{name}.yaml").read_text())["model"]["task"]


@pytest.mark.parametrize("name", ["countdown", "countdown_sim"])
def test_countdown_configs_agree_with_the_reference(name, tmp_path):
    rng = random.Random(name)
    problems = countdown_problems(rng, 60)
    problems += problems[:6]  # repeated prompts: one side of the holdout
    sim = name == "countdown_sim"
    rows = []
    for nums, target, expression in problems:
        row = {"target": target, "nums": nums}
        if sim:
            user = ref.record(row, "countdown", "exact")["messages"][-1]
            answer = {"role": "assistant", "content": f"<think>\nTry {nums}.\n</think>\n<answer>{expression}</answer>"}
            row = {"messages": [{"role": "system", "content": ref.SYSTEM}, user, answer], **row}
        rows.append(row)
    task = build(config(name), {"path": write(tmp_path / "train.jsonl", rows), "config": None})
    records = [ref.record(row, "countdown", "sim" if sim else "exact") for row in rows]
    train, validation = ref.split(records, 500, 42)
    assert len({r["uid"] for r in validation}) == 6  # min(500, max(1, 60 // 10)) distinct prompts
    by_prompt = {json.dumps(r["messages"]): p for r, p in zip(records, problems, strict=True)}

    def completions(record, rng):
        nums, target, expression = by_prompt[json.dumps(record["messages"])]
        texts = countdown_completions(nums, target, expression, rng)
        return texts + (similarity_completions(record["truth"]["reference"], rng)[:6] if sim else [])

    assert check(task, train, validation, completions, rng) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepmath", "deepmath_sim"])
def test_deepmath_configs_agree_with_the_reference(name, tmp_path):
    rng = random.Random(name)
    rows = []
    for i, (question, gold) in enumerate(math_rows(rng, 40)):
        solutions = [
            f"<think>long {i}</think> So the answer is \\boxed{{{gold}}} indeed.",
            "   ",
            f"<think>w</think><answer>{gold}</answer>",
        ][: rng.randint(0, 3)]
        rng.shuffle(solutions)
        row = {"question": question, "final_answer": gold, "difficulty": 5.0, "topic": "t"}
        row |= {f"r1_solution_{k + 1}": text for k, text in enumerate(solutions)}
        rows.append(row)
    rows += rows[:3]
    task = build(config(name), {"path": write(tmp_path / "deepmath.jsonl", rows)})
    records = [ref.record(row, "deepmath", "sim" if name.endswith("sim") else "exact") for row in rows]
    train, validation = ref.split(records, 1000, 42)
    assert len({r["uid"] for r in validation}) == 4  # max(1, 40 // 10) of the 40 distinct prompts

    def completions(record, rng):
        texts = math_completions(record["truth"]["answer"], rng)
        return texts + (similarity_completions(record["truth"]["reference"], rng)[:5] if name.endswith("sim") else [])

    assert check(task, train, validation, completions, rng) > 500


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gsm8k", "gsm8k_sim"])
def test_gsm8k_configs_agree_with_the_reference(name, tmp_path):
    rng = random.Random(name)
    golds = ["72", "1,710", "5", "18", "0", "3"]
    rows = [
        {"question": f" Tom has {i} apples. How many? ", "answer": f"He has {i}.\nSo {g}.\n#### {g}"}
        for i, g in enumerate(golds * 3)
    ]
    write(tmp_path / "gsm8k" / "train.jsonl", rows[:12])
    write(tmp_path / "gsm8k" / "test.jsonl", rows[12:])
    task = build(config(name), {"path": str(tmp_path / "gsm8k"), "config": None})
    reward = "sim" if name.endswith("sim") else "exact"
    train, validation = ([ref.record(r, "gsm8k", reward) for r in part] for part in (rows[:12], rows[12:]))

    def completions(record, rng):
        texts = math_completions(record["truth"]["answer"], rng)
        return texts + (similarity_completions(record["truth"]["reference"], rng)[:5] if reward == "sim" else [])

    assert check(task, train, validation, completions, rng) > 200


def test_openthoughts_config_agrees_with_the_reference(tmp_path):
    rng = random.Random("openthoughts")
    rows = []
    for i in range(130):
        question = f"Explain item {i % 110}, please." + (" " if i % 7 == 0 else "")
        reasoning = " ".join(rng.choice(["so", "the", "value", "is", "an", "apple", "—", "x's"]) for _ in range(12))
        answer = f"The answer to {i % 110} is **{rng.randint(1, 99)}**; a fine result."
        rows.append(
            {
                "difficulty": 3,
                "source": "s",
                "domain": "math",
                "conversations": [
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": f"<think>\n{reasoning}\n</think>\n\n{answer}"},
                ],
            }
        )
    task = build(config("openthoughts"), {"path": write(tmp_path / "openthoughts.jsonl", rows)})
    records = [ref.record(row, "openthoughts", "sim") for row in rows]
    train, validation = ref.split(records, 500, 42)
    assert len({r["uid"] for r in validation}) == len({r["uid"] for r in records}) // 10

    def completions(record, rng):
        return similarity_completions(record["truth"]["reference"], rng)

    # success (a share of completions over a threshold, or the mean reward) is issue 32's item 8: rewards here
    assert check(task, train, validation, completions, rng, success=False) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_1.7b", "qwen3_4b"])
def test_qwen3_configs_agree_with_the_reference(name, tmp_path):
    rng = random.Random(name)
    rows = [{"problem": question, "answer": gold, "difficulty": "3/8"} for question, gold in math_rows(rng, 16)]
    aime = [
        {"problem": rows[0]["problem"], "answer": rows[0]["answer"], "id": 0},
        {"problem": "AIME problem", "answer": "204", "id": 1},
    ]
    math500 = [
        {
            "problem": "MATH problem",
            "solution": "s",
            "answer": "\\frac{1}{2}",
            "subject": "x",
            "level": 2,
            "unique_id": "u",
        }
    ]
    sets = {"aime25": write(tmp_path / "aime25.jsonl", aime), "math500": write(tmp_path / "math500.jsonl", math500)}
    task = build(config(name), {"path": write(tmp_path / "polaris.jsonl", rows), "evaluation_sets": sets})
    evaluation = [ref.record(r, "aime25", "exact") for r in aime] + [ref.record(r, "math500", "exact") for r in math500]
    held = {r["uid"] for r in evaluation}
    train = [r for r in (ref.record(row, "polaris", "exact") for row in rows) if r["uid"] not in held]
    assert len(train) == 15  # the AIME problem left train

    def completions(record, rng):
        return math_completions(record["truth"]["answer"], rng)

    assert check(task, train, evaluation, completions, rng) > 200


def test_every_paper_config_is_checked_here():
    checked = {
        "countdown",
        "countdown_sim",
        "deepmath",
        "deepmath_sim",
        "gsm8k",
        "gsm8k_sim",
        "openthoughts",
        "qwen3_1.7b",
        "qwen3_4b",
    }
    assert {p.stem for p in PAPER.glob("*.yaml")} == checked
