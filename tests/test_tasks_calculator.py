"""The calculator tool task: its tools, examples, reward; the tiny chat model's template (prefix-preserving, tools
rendered, one token per role marker and tool-call tag); its warm start's conversations; episodes through the
multi-turn engine with the task's tool environment."""

from __future__ import annotations

import random

import pytest
import torch

from sgrpo.model.tiny import CHAT_TOKENS, build_chat_tokenizer
from sgrpo.rollout.episodes import multi_turn_problem, run_episodes
from sgrpo.types import Example
from sgrpo.warmstart_tools import Recipe, conversation, environment, sft_row, tool_call
from tasks import CalculatorTask
from tasks.calculator import MAX_OPERAND, add, make_example, mul
from tasks.environment import ToolEnvironment
from tasks.tools import tool_schema

TOOLS = [tool_schema(add), tool_schema(mul)]


def test_tools_compute_and_refuse_what_is_not_an_integer():
    assert add(4087, 7931) == "12018" and mul(4087, 7931) == "32413997" and mul(-12, 3) == "-36"
    for bad in ("4087", 4.0, True, None):
        with pytest.raises(TypeError, match="a must be an integer"):
            mul(bad, 2)
    with pytest.raises(ValueError, match="b must be at most"):
        add(1, MAX_OPERAND + 1)


def test_examples_are_balanced_correct_and_deterministic():
    task = CalculatorTask(levels=[1, 3], num_train=40, num_validation=8, num_test=0, seed=2)
    again = CalculatorTask(levels=[1, 3], num_train=40, num_validation=8, num_test=0, seed=2)
    assert task.examples("train") == again.examples("train")
    assert task.examples("train")[:8] != task.examples("validation")[:8]
    assert task.examples("train") != CalculatorTask(levels=[1, 3], num_train=40, seed=3).examples("train")
    for i, ex in enumerate(task.examples("train")):
        level, op = [1, 3][i % 2], ["add", "mul"][(i // 2) % 2]
        a, b = ex.metadata["a"], ex.metadata["b"]
        assert ex.difficulty == level and ex.metadata["operation"] == op
        assert len(str(a)) == len(str(b)) == level
        assert ex.prompt == [{"role": "user", "content": f"{a}{'+' if op == 'add' else '*'}{b}"}]
        assert ex.answer == str(a + b if op == "add" else a * b)
    assert make_example("mul", 4, random.Random(0)).metadata["a"] >= 1000


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="operations must be a non-empty list"):
        CalculatorTask(operations=["sub"])
    with pytest.raises(ValueError, match=r"levels must be a non-empty list of integers in \[1, 12\]"):
        CalculatorTask(levels=[0, 2])
    with pytest.raises(ValueError, match="num_train must be >= 0"):
        CalculatorTask(num_train=-1)


def test_exact_match_on_the_final_message():
    task = CalculatorTask(num_train=1)
    ex = Example([{"role": "user", "content": "12*34"}], "408", 2)
    completions = ["408", " 408\n", "4080", "", '<tool_call>{"name": "mul"']
    assert task.reward([ex] * 5, completions).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert task.successes([ex] * 5, completions).tolist() == [True, True, False, False, False]


CONVERSATIONS = [
    conversation(Example([{"role": "user", "content": "4087*7931"}], "32413997", 4,
                         {"operation": "mul", "a": 4087, "b": 7931}), use_tool=True),  # fmt: skip
    conversation(Example([{"role": "user", "content": "3+4"}], "7", 1), use_tool=False),
    [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2*3"},
     {"role": "assistant", "content": tool_call("add", {"a": "x"})}, {"role": "tool", "content": "Error: wrong"},
     {"role": "assistant", "content": "6"}],  # fmt: skip
]


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_extends_every_prefix(messages, tools):
    """Each message renders the same whatever follows it, and an assistant turn extends the generation prompt."""
    tok = build_chat_tokenizer()

    def render(k: int, prompt: bool) -> str:
        return tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=prompt, tools=tools)

    for k in range(1, len(messages) + 1):
        text = render(k, False)
        assert text.startswith(render(k - 1, False)) if k > 1 else True
        if messages[k - 1]["role"] == "assistant":
            assert text.startswith(render(k - 1, True)) and text.endswith(messages[k - 1]["content"] + "<eos>")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == text  # nothing lost: every character has a token
        assert tok.pad_token_id not in ids  # (unknown characters would map to <pad>)
    assert text.startswith("<|system|>add(a,b) mul(a,b)<|") == (tools is not None)


def test_chat_tokens_are_single_tokens_and_unknown_roles_are_refused():
    tok = build_chat_tokenizer()
    for marker in CHAT_TOKENS:
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template(CONVERSATIONS[0], tokenize=False, tools=TOOLS)
    assert text.endswith("<|assistant|>32413997<eos>") and "<|tool|>32413997<|assistant|>" in text
    with pytest.raises(Exception, match="unknown role function"):
        tok.apply_chat_template([{"role": "function", "content": "1"}], tokenize=False)
    env = ToolEnvironment([add, mul])
    env.adapt_to_tokenizer(tok)
    assert env.template_renders_tools and multi_turn_problem(tok, env) is None


def test_sft_row_labels_the_assistant_turns_only():
    tok = build_chat_tokenizer()
    messages = CONVERSATIONS[0]
    ids, labels = sft_row(tok, messages, TOOLS)
    whole = tok.apply_chat_template(messages, tokenize=False, tools=TOOLS)
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]  # segments tokenize as the whole does
    learned = tok.decode([i for i, label in zip(ids, labels) if label != -100], skip_special_tokens=False)
    assert learned == messages[1]["content"] + "<eos>" + messages[3]["content"] + "<eos>"
    assert all(label in (-100, i) for i, label in zip(ids, labels))


def _scripted(tok, turns: dict[str, list[str]]):
    """A ``SampleTurns`` that writes, for a context whose user message is a key, its next scripted turn."""

    def sample_turns(contexts: list[list[int]]):
        out = []
        for context in contexts:
            text = tok.decode(context, skip_special_tokens=False)
            question = text.split("<|user|>")[1].split("<|assistant|>")[0]
            turn = turns[question][text.count("<|assistant|>") - 1]
            out.append((tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], None, None))
        return out

    return sample_turns


def test_episodes_of_the_task_run_through_the_engine_token_for_token():
    tok = build_chat_tokenizer()
    task = CalculatorTask(levels=[4], operations=["mul"], num_train=2)
    examples = list(task.examples("train"))
    env = environment(Recipe(operations=("mul",)), tok)
    ex_tool, ex_head = examples
    turns = {ex_tool.prompt[0]["content"]: [conversation(ex_tool, True)[1]["content"], ex_tool.answer],
             ex_head.prompt[0]["content"]: ["123"]}  # fmt: skip
    batch = run_episodes(_scripted(tok, turns), tok, examples, 1, env, [tok.eos_token_id], tok.pad_token_id,
                         torch.device("cpu"), reports=(False, False))  # fmt: skip
    assert batch.completions == [ex_tool.answer, "123"]
    assert task.successes(examples, batch.completions).tolist() == [True, False]
    assert [(e.turns, e.tool_calls, e.tool_failures) for e in batch.episodes] == [(2, 1, 0), (1, 0, 0)]
    assert batch.episodes[0].messages[2] == {"role": "tool", "name": "mul", "content": ex_tool.answer}
    row = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    full = tok.apply_chat_template(batch.episodes[0].messages, tokenize=False, tools=env.schemas)
    assert row == tok(full, add_special_tokens=False)["input_ids"]  # the template's rendering, token for token
    generated = batch.input_ids[0, batch.prompt_length :][batch.completion_mask[0]].tolist()
    assert tok.decode(generated, skip_special_tokens=False) == turns[ex_tool.prompt[0]["content"]][0] + "<eos>" + \
        ex_tool.answer + "<eos>"  # fmt: skip
