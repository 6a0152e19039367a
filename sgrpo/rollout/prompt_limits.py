"""Prompts over a token bound: the longest prompt a rollout can take, and dropping the prompts over it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sgrpo.checks import ConfigError
from sgrpo.rollout.engine import render_prompt
from sgrpo.types import Example

log = logging.getLogger(__name__)


def prompt_limit(
    model, max_prompt_tokens: int | None, max_new_tokens: int, engine_tokens: int | None = None,
    engine: str = "rollout",
) -> int | None:
    """The longest prompt a rollout can take (``prompt_room`` with the model's ``max_position_embeddings``)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return prompt_room(positions, engine_tokens, max_prompt_tokens, max_new_tokens, engine)


def prompt_room(
    positions: int | None, engine_tokens: int | None, max_prompt_tokens: int | None, max_new_tokens: int,
    engine: str = "rollout",
) -> int | None:
    """``max_prompt_tokens``, else the total length less ``max_new_tokens``; None: no bound is known.

    The total is the smaller of the model's ``positions`` and the rollout engine's own limit on prompt +
    completion (``RolloutEngine.max_total_tokens``: vLLM's ``max_model_len``), of those known. A
    ``max_prompt_tokens`` that leaves the completion less than ``max_new_tokens`` of that total is refused
    (``ConfigError``): such a prompt would stop vLLM mid-run, or run past the model's positions. ``engine``
    names the engine's key in the message (``rollout`` or ``val_rollout``).
    """
    limits = ((engine_tokens, f"model.{engine}'s max_model_len"), (positions, "the model's max_position_embeddings"))
    known = [(n, what) for n, what in limits if n is not None]
    if not known:
        return max_prompt_tokens
    total, what = min(known)
    room, new = total - max_new_tokens, f"model.{engine} max_new_tokens={max_new_tokens}"
    if room < 1:
        raise ConfigError(f"{new} leaves no room for a prompt in {what} ({total} tokens); lower max_new_tokens")
    if max_prompt_tokens is not None and max_prompt_tokens > room:
        raise ConfigError(
            f"model.max_prompt_tokens={max_prompt_tokens} + {new} exceed {what} ({total} tokens), so a prompt that "
            f"long would fail mid-run: set max_prompt_tokens <= {room} (or null: what is left), or lower max_new_tokens"
        )
    return room if max_prompt_tokens is None else max_prompt_tokens


def within_limit(
    examples: Sequence[Example], tokenizer, limit: int | None, split: str
) -> tuple[list[Example], int]:
    """The examples whose prompt (as the rollout renders it) has at most ``limit`` tokens, and how many were dropped.

    A text longer than ``limit`` x the longest token of the vocabulary (in characters) has more than
    ``limit`` tokens: it is dropped without being tokenized, so a 10 MB question costs a ``len``.
    The others are tokenized in batches.
    """
    if limit is None:
        return list(examples), 0
    longest = max(map(len, tokenizer.get_vocab()))  # characters one token can cover, at most
    texts = [render_prompt(tokenizer, ex.prompt, ex.chat_template_kwargs) for ex in examples]
    short = [i for i, text in enumerate(texts) if len(text) <= limit * longest]
    keep = set()
    for start in range(0, len(short), 1024):
        rows = short[start : start + 1024]
        ids = tokenizer([texts[i] for i in rows], add_special_tokens=False)["input_ids"]
        keep.update(i for i, row in zip(rows, ids, strict=True) if len(row) <= limit)
    kept = [ex for i, ex in enumerate(examples) if i in keep]
    dropped = len(examples) - len(kept)
    if examples and not kept:
        raise ConfigError(
            f"every {split} prompt is longer than the prompt limit, {limit} tokens: raise model.max_prompt_tokens if "
            f"it is set, else lower the rollout's max_new_tokens (or raise its max_model_len) to leave prompts room"
        )
    if dropped:
        log.warning("dropped %d of %d %s prompts longer than %d tokens (the prompt limit)", dropped, len(examples),
                    split, limit)  # fmt: skip
    return kept, dropped
