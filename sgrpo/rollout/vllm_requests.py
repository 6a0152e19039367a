"""What a vLLM request is and what its output becomes: prompt token ids, ``SamplingParams`` keyword arguments, and
vLLM's ``RequestOutput`` s as a ``RolloutBatch`` (rows ``b * G + g``). Pure functions with CPU tests, shared by the
vLLM engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sgrpo.rollout.engine import render_prompt
from sgrpo.types import Example, RolloutBatch


# ---------------------------------------------------------------------------------------------- requests
def prompt_token_ids(tokenizer, examples: Sequence[Example]) -> list[list[int]]:
    """Token ids of each rendered prompt, without special tokens added (the same ids HFRollout feeds)."""
    texts = [render_prompt(tokenizer, ex.prompt, ex.chat_template_kwargs) for ex in examples]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def fitting_prompt_ids(tokenizer, examples: Sequence[Example], max_model_len: int | None) -> list[list[int]]:
    """``prompt_token_ids``, refused when a prompt leaves no room for a completion in ``max_model_len``."""
    prompts = prompt_token_ids(tokenizer, examples)
    longest = max((len(p) for p in prompts), default=0)
    if max_model_len is not None and longest >= max_model_len:
        raise ValueError(f"a prompt has {longest} tokens, max_model_len is {max_model_len}: raise it")
    return prompts


def sampling_kwargs(
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_token_ids: Sequence[int],
    greedy: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt's group.

    ``logprobs=0`` returns the log-prob of the sampled token only. Greedy decoding asks for one
    completion (``n=1``, temperature 0): vLLM's greedy samples are identical copies, so the output
    conversion repeats that one completion ``group_size`` times instead of decoding it G times.
    """
    kwargs: dict[str, Any] = {
        "n": 1 if greedy else group_size,
        "max_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "logprobs": 0,
    }
    if greedy:
        return kwargs | {"temperature": 0.0}
    return kwargs | {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}


# ---------------------------------------------------------------------------------------------- outputs
def rollout_batch_from_outputs(
    outputs: Sequence[Any], group_size: int, pad_id: int, tokenizer=None, device: torch.device | None = None
) -> RolloutBatch:
    """vLLM ``RequestOutput`` s (one per prompt, in prompt order) -> ``RolloutBatch`` with rows ``b * G + g``.

    Reads ``RequestOutput.prompt_token_ids`` and ``.outputs`` (``CompletionOutput`` s with ``.index``,
    ``.token_ids``, ``.logprobs``, ``.finish_reason``, ``.text``). A request with one completion
    (greedy) fills its whole group. vLLM stops at EOS and keeps it in ``token_ids``, so every
    generated token is in the completion mask; ``finish_reason == "length"`` marks truncation.
    Texts are decoded by ``tokenizer`` (skipping special tokens, as HFRollout does), or taken from
    ``.text`` without one. Log-probs are those of the sampled tokens, 0 on padding.
    """
    prompts, completions, logprobs, truncated, texts = [], [], [], [], []
    for request in outputs:
        samples = sorted(request.outputs, key=lambda c: c.index)
        if not samples or group_size % len(samples):
            raise ValueError(f"a request returned {len(samples)} completions for a group of {group_size}")
        for sample in samples:
            ids = list(sample.token_ids)
            row_logprobs = _sampled_logprobs(sample.logprobs, ids)
            for _ in range(group_size // len(samples)):
                prompts.append(torch.tensor(list(request.prompt_token_ids), dtype=torch.long, device="cpu"))
                completions.append(torch.tensor(ids, dtype=torch.long, device="cpu"))
                logprobs.append(row_logprobs)
                truncated.append(sample.finish_reason == "length")
                texts.append(sample.text)
    if tokenizer is not None:
        texts = tokenizer.batch_decode([c.tolist() for c in completions], skip_special_tokens=True)
    pad = nn.utils.rnn.pad_sequence
    prompt_ids = pad(prompts, batch_first=True, padding_value=pad_id, padding_side="left")  # [N, P]
    completion_ids = pad(completions, batch_first=True, padding_value=pad_id)  # [N, T]
    if completion_ids.shape[1] == 0:  # every completion empty: keep one (masked) column
        completion_ids = torch.full((len(completions), 1), pad_id, dtype=torch.long, device="cpu")
    p, t = prompt_ids.shape[1], completion_ids.shape[1]
    prompt_len = torch.tensor([len(x) for x in prompts], device="cpu")  # [N]
    completion_len = torch.tensor([len(x) for x in completions], device="cpu")  # [N]
    prompt_mask = torch.arange(p, device="cpu") >= (p - prompt_len).unsqueeze(-1)  # [N, P]
    completion_mask = torch.arange(t, device="cpu") < completion_len.unsqueeze(-1)  # [N, T]
    sampled = None
    if all(lp is not None for lp in logprobs):
        sampled = torch.zeros(len(completions), t, dtype=torch.float32, device="cpu")  # [N, T]
        for row, lp in enumerate(logprobs):
            sampled[row, : len(lp)] = torch.tensor(lp, dtype=torch.float32, device="cpu")
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, completion_ids], 1).to(device),
        attention_mask=torch.cat([prompt_mask, completion_mask], 1).long().to(device),
        completion_mask=completion_mask.to(device),
        completions=list(texts),
        truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
        group_size=group_size,
        logprobs=None if sampled is None else sampled.to(device),
    )


def _sampled_logprobs(steps: Sequence[Any] | None, ids: list[int]) -> list[float] | None:
    """``CompletionOutput.logprobs`` (per step: {token id: Logprob}) -> the sampled tokens' log-probs."""
    if steps is None:
        return None
    if len(steps) != len(ids):
        raise ValueError(f"{len(steps)} log-prob steps for {len(ids)} generated tokens")
    return [float(step[token].logprob) for step, token in zip(steps, ids)]


# ---------------------------------------------------------------------------------------------- engine
