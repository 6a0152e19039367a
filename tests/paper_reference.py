"""An independent reference of the SoftmaxGRPO authors' rewards, prompts and holdouts (issue 32), written from the
rules their release states (jeffhernandez1995/softmaxgrpo: rewards.py, prepare_data.py), sharing no code with
sgrpo's tasks: tests/test_paper_reference.py grades the same completions both ways under every paper config.

Deliberately other mechanisms than sgrpo's where the rule allows: regular expressions for the final text and the
words, Python's ``tokenize`` and a shunting-yard evaluator for Countdown (sgrpo walks ``ast``), ``hashlib`` by hand
for the holdout.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import string
import tokenize
from collections import Counter
from fractions import Fraction

SYSTEM = "You are a helpful assistant. Think through the problem before providing the answer."
OPENTHOUGHTS_SYSTEM = SYSTEM + " Put your reasoning in <think> </think> tags, followed by your final answer."
SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


# ---- rewards ----------------------------------------------------------------------------------------------------


def final_text(text: str) -> str:
    text = str(text).replace("<|im_end|>", "").replace("<|endoftext|>", "").strip()
    if "</think>" in text:
        text = text.split("</think>")[-1].strip()
    blocks = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return (blocks[-1] if blocks else text).strip()


def words(text: str) -> list[str]:
    text = final_text(text).lower()
    text = "".join(c for c in text if c not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def lcs(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        previous_diagonal = 0
        for j, y in enumerate(b, 1):
            previous_diagonal, row[j] = row[j], previous_diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def similarity(prediction: str, reference: str) -> float:
    p, g = words(prediction), words(reference)
    if not p or not g:
        return 0.0
    overlap = sum(min(n, Counter(g)[w]) for w, n in Counter(p).items())
    return 0.6 * (2 * overlap / (len(p) + len(g))) + 0.4 * (2 * lcs(p, g) / (len(p) + len(g)))


def think_format(text: str) -> float:
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    match = re.fullmatch(r"\s*<think>(.*?)</think>\s*(.*?)\s*", text, flags=re.S)
    return float(bool(match) and bool(match.group(1).strip()) and bool(match.group(2).strip()))


def math_correct(text: str, gold: str) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    expected = parse("\\boxed{" + str(gold) + "}", extraction_config=[LatexExtractionConfig()])
    actual = parse(final_text(text), extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    return 1.0 if expected and actual and verify(expected, actual) else 0.0


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _tokens(expression: str) -> list:
    """Python's tokens of ``expression``: integer literals as ints, the four operators and parentheses as strings;
    ValueError for anything else (Python's tokenizer reads the literal spellings: 0x10, 1_000, 00)."""
    out: list = []
    ended = False  # a logical line ended (a newline outside parentheses): nothing may follow
    try:
        for token in tokenize.generate_tokens(io.StringIO(expression).readline):
            if token.type in (tokenize.NL, tokenize.ENDMARKER, tokenize.COMMENT, tokenize.DEDENT):
                continue
            if token.type in (tokenize.NEWLINE, tokenize.INDENT):
                ended = True
                continue
            if ended:
                raise ValueError("a second line")
            if token.type == tokenize.NUMBER:
                if re.fullmatch(r"[0-9_]+|0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+", token.string) is None:
                    raise ValueError(token.string)  # floats, imaginaries, exponents
                value = int(token.string, 0)
                if value > 10**6:
                    raise ValueError(token.string)
                out.append(value)
            elif token.type == tokenize.OP and token.string in "+-*/()" and len(token.string) == 1:
                out.append(token.string)
            else:
                raise ValueError(token.string)
    except (tokenize.TokenError, IndentationError, SyntaxError) as err:
        raise ValueError(str(err)) from err
    return out


def _evaluate(tokens: list) -> tuple[Fraction, list[int]]:
    """Shunting-yard over infix tokens; no unary operators, no adjacent operands."""
    values: list[Fraction] = []
    operators: list[str] = []
    used: list[int] = []
    expect_operand = True

    def apply() -> None:
        op = operators.pop()
        right, left = values.pop(), values.pop()
        values.append({"+": left + right, "-": left - right, "*": left * right, "/": left / right}[op])

    for token in tokens:
        if isinstance(token, int):
            if not expect_operand:
                raise ValueError("two operands in a row")
            used.append(token)
            values.append(Fraction(token))
            expect_operand = False
        elif token == "(":
            if not expect_operand:
                raise ValueError("implicit product")
            operators.append(token)
        elif token == ")":
            if expect_operand:
                raise ValueError("empty parentheses or a dangling operator")
            while operators and operators[-1] != "(":
                apply()
            if not operators:
                raise ValueError("unbalanced")
            operators.pop()
        else:
            if expect_operand:
                raise ValueError("unary sign")
            while operators and operators[-1] != "(" and _PRECEDENCE[operators[-1]] >= _PRECEDENCE[token]:
                apply()
            operators.append(token)
            expect_operand = True
    if expect_operand:
        raise ValueError("ends with an operator")
    while operators:
        if operators[-1] == "(":
            raise ValueError("unbalanced")
        apply()
    return values[0], used


def countdown_correct(text: str, numbers: list[int], target: int) -> float:
    expression = final_text(text)
    for a, b in (("×", "*"), ("÷", "/"), ("−", "-")):
        expression = expression.replace(a, b)
    box = re.search(r"\\boxed\{([^{}]*)\}", expression)
    if box:
        expression = box.group(1)
    expression = expression.strip().strip("$`").strip()
    while expression.endswith("."):
        expression = expression[:-1]
    if len(expression) > 256 or expression.count("=") > 1:
        return 0.0
    if "=" in expression:
        expression, right = expression.split("=")
        try:
            if Fraction(right.strip()) != target:
                return 0.0
        except (ValueError, ZeroDivisionError):
            return 0.0
    try:
        value, used = _evaluate(_tokens(expression.strip()))
    except (ValueError, ZeroDivisionError, IndexError):
        return 0.0
    return float(sorted(used) == sorted(numbers) and value == target)


# ---- prompts, references and holdouts (prepare_data's records) ------------------------------------------------


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None or not str(value).strip():
        raise ValueError(f"no {key}")
    return str(value).strip()


def record(row: dict, task: str, reward: str) -> dict:
    """{messages, uid, truth} of one source row, as the authors prepare it."""
    system: str | None = SYSTEM
    truth: dict = {"task": task, "reward": reward}
    if task == "gsm8k":
        solution = _text(row, "answer")
        truth.update(answer=solution.split("####")[-1].strip(), reference=solution)
        user = _text(row, "question") + "\n" + SUFFIX
    elif task == "deepmath":
        finals = []
        for key in ("r1_solution_1", "r1_solution_2", "r1_solution_3"):
            if row.get(key) and final_text(row[key]):
                finals.append(final_text(row[key]))
        shortest = sorted(finals, key=len)[0] if finals else None  # sorted is stable: the first on a tie
        truth.update(answer=_text(row, "final_answer"), reference=shortest or _text(row, "final_answer"))
        user = _text(row, "question") + "\n" + SUFFIX
    elif task == "countdown":
        nums, target = [int(n) for n in row["nums"]], int(row["target"])
        said = [m["content"] for m in row.get("messages", []) if m["role"] == "assistant"]
        truth.update(numbers=nums, target=target, reference=said[-1] if said else "")
        user = (f"Using the numbers {nums}, create an equation that equals {target}. Use only +, -, *, / and "
                "parentheses, and use each number exactly once. Show your work in <think> </think> tags and return "
                "the final expression in <answer> </answer> tags.")  # fmt: skip
    elif task == "openthoughts":
        turns = row["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"]
        user, system = turns[0]["value"], OPENTHOUGHTS_SYSTEM
        truth["reference"] = turns[1]["value"]
    elif task in ("polaris", "aime25", "math500"):
        user, system = _text(row, "problem") + "\n" + SUFFIX, None
        truth["answer"] = _text(row, "answer")
    else:
        raise ValueError(task)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    uid = hashlib.sha256(json.dumps(messages, sort_keys=True).encode("utf-8")).hexdigest()
    return {"messages": messages, "uid": uid, "truth": truth}


def split(records: list[dict], size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): grouped_split's rule."""
    uids = sorted({r["uid"] for r in records})
    order = sorted(uids, key=lambda u: hashlib.sha256((str(seed) + ":" + u).encode("utf-8")).digest())
    held = set(order[: min(size, max(1, len(uids) // 10))])
    return [r for r in records if r["uid"] not in held], [r for r in records if r["uid"] in held]


def score(truth: dict, completion: str) -> dict:
    """{"score", "accuracy"?} of a completion: compute_score's rule."""
    out = {}
    if truth["task"] == "countdown":
        out["accuracy"] = countdown_correct(completion, truth["numbers"], truth["target"])
    elif truth["task"] != "openthoughts":
        out["accuracy"] = math_correct(completion, truth["answer"])
    if truth["reward"] == "exact":
        out["score"] = out["accuracy"]
    elif truth["task"] == "openthoughts":
        out["score"] = 0.35 * think_format(completion) + 0.65 * similarity(completion, truth["reference"])
    else:
        out["score"] = similarity(completion, truth["reference"])
    return out
