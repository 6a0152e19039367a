"""Tiny local models for tests, smoke configs and the quickstart: a character tokenizer and a small Llama.

Everything here is built offline and saved in HF format, so it loads through the same
``from_pretrained`` path as a hub model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

#: characters of the synthetic tasks (digits, operators, the sort marker)
SYNTHETIC_CHARS = "0123456789+=:s"
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
#: the chat model's characters: printable ASCII and the newline (tool calls' JSON, tools' errors)
CHAT_CHARS = "".join(map(chr, range(32, 127))) + "\n"
#: the chat model's multi-character tokens: role markers and the Hermes / Qwen tool-call tags
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>")
#: a prefix-preserving chat template for ``build_chat_tokenizer``: ``<|role|>content`` per message, an assistant
#: turn closed by ``<eos>`` (its end-of-turn token), the tools (``tools=[JSON schemas]``) as one system line
#: ``<|system|>add(a,b) mul(a,b)``; each message renders the same whatever follows it
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>{%- for t in tools -%}{{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(',') }}){{ ' ' if not loop.last }}{%- endfor -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content }}<eos>"
    "{%- elif m.role in ['system', 'user', 'tool'] -%}<|{{ m.role }}|>{{ m.content }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m.role ~ ': use system, user, assistant or tool') }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_char_tokenizer(chars: str = SYNTHETIC_CHARS) -> PreTrainedTokenizerFast:
    """One token per character, plus ``<pad>`` (0), ``<bos>`` (1) and ``<eos>`` (2); decodes by concatenation."""
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )


def build_chat_tokenizer(chars: str = CHAT_CHARS, template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """``build_char_tokenizer(chars)`` with ``CHAT_TOKENS`` as single tokens (after the characters) and
    ``template`` as its chat template: a tiny chat model's tokenizer, for multi-turn tool use."""
    tokenizer = build_char_tokenizer(chars)
    tokenizer.add_tokens(list(CHAT_TOKENS))
    tokenizer.chat_template = template
    return tokenizer


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 64,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A small randomly initialised Llama (RoPE, so left padding is safe) for ``tokenizer``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def ensure_tiny_model(path: str | Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Build and save a tiny char-level Llama at ``path`` unless one with the same recipe is there."""
    path = Path(path)
    recipe = {"hidden_size": hidden_size, "num_layers": num_layers, "seed": seed, "chars": SYNTHETIC_CHARS}
    stamp = path / "sgrpo_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(recipe))
    return path
