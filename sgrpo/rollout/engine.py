"""What every rollout engine shares: the ``RolloutEngine`` contract (G completions per prompt as a ``RolloutBatch``),
prompt rendering, and the token-level helpers (end-of-sequence masks, left padding, stop and pad ids)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sgrpo.types import Example, Messages, RolloutBatch


def render_prompt(tokenizer, prompt: str | Messages, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Raw text stays as is; chat messages go through the tokenizer's chat template (a plain one if none),
    with ``chat_template_kwargs`` (an ``Example``'s: Qwen3's ``enable_thinking``)."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        kwargs = dict(chat_template_kwargs or {})
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in prompt]
    return "\n\n".join(turns) + "\n\nAssistant:"


def completion_mask_until_eos(ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``ids`` ``[N, T]`` -> (mask ``[N, T]`` of tokens up to and including the first EOS, truncated ``[N]``)."""
    is_eos = torch.isin(ids, torch.as_tensor(list(eos_ids), device=ids.device))  # [N, T]
    seen_before = is_eos.long().cumsum(-1) - is_eos.long()  # EOS tokens strictly before each position
    return seen_before == 0, ~is_eos.any(-1)


class RolloutEngine(ABC):
    """Generates ``group_size`` completions for each example; rows are ordered ``b * G + g``."""

    max_new_tokens: int
    temperature: float
    #: True when the engine samples through the trained model's own modules and weights: its log-probs
    #: (if any) are the policy's up to float rounding, so no importance weights and no second forward
    samples_from_policy: bool = True
    #: the longest prompt + completion the engine takes (vLLM: ``max_model_len``); None: the model's positions
    max_total_tokens: int | None = None
    #: True when the engine runs multi-turn episodes (``generate_episodes``, ``model.environment``)
    runs_episodes: bool = False

    @abstractmethod
    def generate(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, greedy: bool = False
    ) -> RolloutBatch: ...

    def generate_episodes(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, environment,
        greedy: bool = False,
    ) -> RolloutBatch:  # fmt: skip
        """``group_size`` multi-turn episodes of ``environment`` (``tasks.environment.Environment``) per example
        (``sgrpo.rollout.episodes``); engines with ``runs_episodes`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not run multi-turn episodes (model.environment)")

    def truncation(self) -> str | None:
        """Which setting that training refuses makes the sampled distribution differ from softmax(logits / T), or None.

        The policy loss computes log-probs of the full softmax, so training refuses top-k and a forced
        minimum length; validation may use them. Top-p is allowed, as verl allows it: tokens are drawn
        from the nucleus (the smallest top set holding ``top_p`` of the mass) while the loss's log-probs
        stay the full softmax's, a bias of at most -log(kept mass) per token in the importance ratio
        (``train/rollout/nucleus_mass`` logs the kept mass where the engine reports it).
        """
        settings = {"top_k": 0, "min_new_tokens": 0}
        changed = [f"{k}={getattr(self, k)}" for k, off in settings.items() if getattr(self, k, off) != off]
        return ", ".join(changed) or None

    def hold(self) -> None:  # noqa: B027 (a hook: engines without state between calls need none)
        """Keep the engine ready between ``generate`` calls until ``release`` (a validation's batches); no-op here."""

    def release(self) -> None:  # noqa: B027
        """End a ``hold``: the engine gives its memory back as after any ``generate``; no-op here."""


#: the attribute holding a model's weights version (``bump_weights_version``)
WEIGHTS_VERSION = "sgrpo_weights_version"


def weights_version(model: nn.Module) -> int | None:
    """The weights version of ``model`` (bumped by every optimiser step and checkpoint load), or None: unknown.

    An engine that keeps its own copy of the weights (vLLM) copies them again only when it changed;
    unknown means always.
    """
    return getattr(model, WEIGHTS_VERSION, None)


def bump_weights_version(model: nn.Module) -> int:
    """Mark ``model``'s weights as changed (after an optimiser step, a checkpoint load); the new version."""
    version = (weights_version(model) or 0) + 1
    object.__setattr__(model, WEIGHTS_VERSION, version)  # a plain attribute: no state dict entry, no hook
    return version


def left_padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token id lists -> (ids ``[B, P]`` left-padded with ``pad``, attention mask ``[B, P]``: 1 on real tokens).

    The mask comes from the rows' lengths, never from ``ids != pad``: the pad id may be EOS, which a prompt
    can hold. The tokenizer's own padding is not used, so a tokenizer without a pad token works as it is.
    """
    tensors = [torch.tensor(list(row), dtype=torch.long, device="cpu") for row in rows]
    ids = nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad, padding_side="left")  # [B, P]
    lengths = torch.tensor([len(t) for t in tensors], device="cpu")  # [B]
    mask = torch.arange(ids.shape[1], device="cpu") >= (ids.shape[1] - lengths).unsqueeze(-1)  # [B, P]
    return ids.to(device), mask.long().to(device)


def with_pad_token(tokenizer):
    """``tokenizer``, its pad token set to its EOS token when it has none (Llama-3.x, Mistral), as TRL does.

    Safe because sgrpo's masks come from lengths and attention masks, never from comparing ids with the
    pad id: a completion ends at its first EOS, and padding after it is masked whatever its id.
    """
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_and_pad_ids(model: nn.Module, tokenizer) -> tuple[list[int], int]:
    """The ids that end a completion (the model's generation_config, else the tokenizer's) and the pad id
    (the tokenizer's, else the first end id)."""
    eos = eos_ids(model, tokenizer)
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def eos_ids(model: nn.Module, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer and the model's generation_config define no eos_token_id; set one")
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
