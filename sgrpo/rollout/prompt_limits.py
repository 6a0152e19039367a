"""Prompts over a token bound: the longest prompt a rollout can take, and dropping the prompts over it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sgrpo.checks import ConfigError
from sgrpo.lazy import is_lazy, take
from sgrpo.rollout.engine import render_prompt
from sgrpo.types import Example

log = logging.getLogger(__name__)


def prompt_limit(
    config, max_prompt_tokens: int | None, max_new_tokens: int, engine_tokens: int | None = None,
    engine: str = "rollout",
) -> int | None:
    """The longest prompt a rollout can take (``prompt_room`` with the ``max_position_embeddings`` of ``config``, the
    model's config, or None where there is none)."""
    positions = getattr(config, "max_position_embeddings", None)
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
    examples: Sequence[Example], tokenizer, limit: int | None, split: str,
    rendered: Callable[[Example], str] | None = None,
) -> tuple[Sequence[Example], int]:
    """The examples whose prompt (as the rollout renders it) has at most ``limit`` tokens, and how many were dropped.

    ``rendered`` gives an example's text as the rollout starts from it: by default its prompt through the chat
    template (``render_prompt``); a multi-turn policy passes its episodes' opening
    (``sgrpo.rollout.episodes.opening_text``: the environment's system message and tool schemas count too).

    A text longer than ``limit`` x the longest token of the vocabulary (in characters) has more than
    ``limit`` tokens: it is dropped without being tokenized, so a 10 MB question costs a ``len``.
    The others are tokenized in batches of 1,024, read one batch at a time: a lazy ``examples`` (``sgrpo.lazy``,
    a memory-mapped data set) stays lazy, the kept ones a view of it (``take``), a list a list.
    """
    if limit is None:
        return (examples if is_lazy(examples) else list(examples)), 0
    longest = max(map(len, tokenizer.get_vocab()))  # characters one token can cover, at most
    keep: list[int] = []
    texts: list[tuple[int, str]] = []
    for index, ex in enumerate(examples):
        text = rendered(ex) if rendered is not None else render_prompt(tokenizer, ex.prompt, ex.chat_template_kwargs)
        if len(text) <= limit * longest:
            texts.append((index, text))
        if len(texts) == 1024 or (texts and index == len(examples) - 1):
            ids = tokenizer([text for _, text in texts], add_special_tokens=False)["input_ids"]
            keep.extend(i for (i, _), row in zip(texts, ids, strict=True) if len(row) <= limit)
            texts = []
    kept = take(examples, keep)
    dropped = len(examples) - len(kept)
    if examples and not kept:
        raise ConfigError(
            f"every {split} prompt{' (an episode opening: the environment adds to it)' if rendered else ''} is longer "
            f"than the prompt limit, {limit} tokens: raise model.max_prompt_tokens if it is set, else lower the "
            f"rollout's max_new_tokens (or raise its max_model_len) to leave prompts room"
        )
    if dropped:
        log.warning("dropped %d of %d %s prompts longer than %d tokens (the prompt limit)", dropped, len(examples),
                    split, limit)  # fmt: skip
    return kept, dropped
