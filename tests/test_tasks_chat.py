"""Chat-template options: a task's system prompt and chat_template_kwargs, rendered alike everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import HFRollout, render_prompt
from sgrpo.rollout.prompt_limits import within_limit
from sgrpo.rollout.vllm_requests import prompt_token_ids
from sgrpo.types import Example
from tasks import GSM8K, DeepMath, ExactMatch, MeetingBank, PoetryWriting, SyntheticTask, Task
from tasks.similarity import template_opens_think

FIXTURES = Path(__file__).parent / "fixtures"
#: a thinking model's template (R1-like: the generation prompt opens <think>) that a kwarg turns off, as
#: Qwen3's enable_thinking does (it closes the block in the prompt)
SWITCH = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
#: the same switch in characters the tiny model's tokenizer has: "=" opens the answer, ":" marks thinking off
CHARS = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% if enable_thinking is defined and not enable_thinking %}:{% endif %}{% endif %}"
)
OFF = {"enable_thinking": False}


def tokenizer_with(template: str):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_render_prompt_and_the_think_check_pass_the_kwargs_to_the_template():
    tokenizer, chat = tokenizer_with(SWITCH), [{"role": "user", "content": "1+1?"}]
    assert render_prompt(tokenizer, chat) == "<|user|>1+1?<|assistant|><think>\n"
    assert render_prompt(tokenizer, chat, OFF) == "<|user|>1+1?<|assistant|><think>\n\n</think>\n\n"
    assert render_prompt(tokenizer, "s:31=", OFF) == "s:31="  # raw text is never templated
    assert template_opens_think(tokenizer) is True and template_opens_think(tokenizer, OFF) is False


@pytest.mark.parametrize(("kwargs", "require_think"), [(None, True), (OFF, False)])
def test_deepmath_reads_the_template_as_its_prompts_are_rendered(kwargs, require_think):
    task = DeepMath(path=str(FIXTURES / "deepmath.jsonl"), chat_template_kwargs=kwargs)
    task.adapt_to_tokenizer(tokenizer_with(SWITCH))
    assert task.reward.require_think is require_think and task.success_grader.require_think is require_think


def test_a_task_opens_every_chat_prompt_with_its_system_prompt_and_carries_the_kwargs():
    gsm8k = GSM8K(path=str(FIXTURES / "gsm8k.jsonl"), system_prompt="Be brief.", chat_template_kwargs=OFF)
    for example in gsm8k.examples("train") + gsm8k.examples("validation"):
        assert example.prompt[0] == {"role": "system", "content": "Be brief."} and example.prompt[1]["role"] == "user"
        assert example.chat_template_kwargs == OFF
    assert GSM8K(path=str(FIXTURES / "gsm8k.jsonl")).examples("train")[0].prompt[0]["role"] == "user"
    meetingbank = MeetingBank(path=str(FIXTURES / "meetingbank.jsonl"), system_prompt="Summarise.")
    assert [m["role"] for m in meetingbank.examples("train")[0].prompt] == ["system", "user"]
    assert meetingbank.examples("train")[0].chat_template_kwargs == {}
    with pytest.raises(ValueError, match="system_prompt needs chat prompts"):
        PoetryWriting(path=str(FIXTURES / "poetry.jsonl"), chat=False, system_prompt="You are a poet.")
    with pytest.raises(ValueError, match="system_prompt needs chat prompts; SyntheticTask gave raw text"):
        SyntheticTask(num_train=4, system_prompt="Sort.").examples("train")


def test_an_examples_own_kwargs_win_over_the_tasks():
    class Own(Task):
        def load(self, split):
            return [Example([{"role": "user", "content": "q"}], "a", chat_template_kwargs={"enable_thinking": True})]

        def success(self, example, completion):
            return True

    example = Own(ExactMatch(), chat_template_kwargs={"enable_thinking": False, "x": 1}).examples("train")[0]
    assert example.chat_template_kwargs == {"enable_thinking": True, "x": 1}


def test_system_prompt_and_kwargs_are_config_keys():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    init = {"path": str(FIXTURES / "deepmath.jsonl"), "system_prompt": "Think.", "chat_template_kwargs": OFF}
    task = parser.instantiate(parser.parse_object({"task": {"class_path": "tasks.DeepMath", "init_args": init}})).task
    example = task.examples("train")[0]
    assert example.prompt[0]["content"] == "Think." and example.chat_template_kwargs == OFF


def test_the_rollout_the_vllm_requests_and_the_length_guard_render_with_the_kwargs():
    tokenizer = tokenizer_with(CHARS)
    model = build_tiny_llama(tokenizer)
    chat = [{"role": "user", "content": "s:31"}]
    examples = [Example(chat, "13"), Example(chat, "13", chat_template_kwargs=OFF)]
    torch.manual_seed(0)
    batch = HFRollout(max_new_tokens=3).generate(model, tokenizer, examples, group_size=2)
    prompts = [
        tokenizer.decode(batch.input_ids[row, : batch.prompt_length], skip_special_tokens=True) for row in (0, 2)
    ]
    assert prompts == ["s:31=", "s:31=:"]
    assert [len(ids) for ids in prompt_token_ids(tokenizer, examples)] == [5, 6]
    kept, dropped = within_limit(examples, tokenizer, limit=5, split="train")
    assert kept == examples[:1] and dropped == 1  # the kwargs made the second prompt one token longer


def test_the_docs_example_is_a_valid_task_config():
    page = (Path(__file__).parents[1] / "docs" / "tasks.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.S) if "chat_template_kwargs" in b)
    config = yaml.safe_load(block)["model"]["task"]
    config["init_args"]["path"] = str(FIXTURES / "gsm8k.jsonl")  # offline
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    task = parser.instantiate(parser.parse_object({"task": config})).task
    assert task.examples("train")[0].prompt[0]["role"] == "system" and task.chat_template_kwargs == OFF
