"""A tiny chat model for multi-turn tests: a character tokenizer with chat special tokens, two chat templates
written here (one that extends the previous tokens turn after turn, one that strips earlier thinking as Qwen3's
does), and environments that answer in known ways."""

from __future__ import annotations

import torch
from torch import nn

from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.types import Example
from tasks.environment import Environment, Observation

CHARS = "0123456789+=: abcdefghijklmnopqrstuvwxyz\n"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
#: every message as <|im_start|>role\ncontent<|im_end|>: each rendering extends the one before
PREFIX = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the generation prompt opens <think>, and rendered assistant turns keep only what follows </think> (Qwen3,
#: DeepSeek-R1): a conversation rendered again no longer starts with the tokens the model saw
STRIP = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)
EXAMPLES = [Example([{"role": "user", "content": "add 12 and 30"}], "42"), Example("what is 7 + 5", "12")]


def chat_tokenizer(template: str | None = PREFIX):
    tokenizer = build_char_tokenizer(CHARS)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


def chat_model(tokenizer, eos_bias: float = 2.5, seed: int = 0) -> nn.Module:
    """A tiny Llama whose LM head favours the end-of-turn token (turns of a few tokens), float32, eval mode."""
    model = build_tiny_llama(tokenizer, hidden_size=32, max_positions=512, seed=seed)
    weight = model.lm_head.weight
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = eos_bias
    model.lm_head = head
    return model.eval()


class Reply(Environment):
    """Answers every turn with a user message; a reward of 0.25 per turn."""

    def step(self, example: Example, messages) -> Observation:
        turns = sum(m["role"] == "assistant" for m in messages)
        return Observation([{"role": "user", "content": f"go on {turns}"}], reward=0.25)


#: a chat template in the characters of sgrpo.model.tiny's synthetic tokenizer (the tests' shared tiny model): an
#: assistant turn is "=" (the generation prompt), its text and <eos>, so each rendering extends the one before
DIGITS_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}<eos>{% else %}{{ m['content'] }}:"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


class Digits(Environment):
    """Answers every turn with "1+1" (characters the synthetic tokenizer has)."""

    def step(self, example: Example, messages) -> Observation:
        return Observation([{"role": "user", "content": "1+1"}])


class Broken(Environment):
    def step(self, example: Example, messages) -> Observation:
        raise KeyError("no such state")
