"""Multi-turn episodes from the colocated vLLM engine: the episode loop of ``sgrpo.rollout.episodes``, each turn of
every running episode one vLLM request of one sample whose prompt is the row's own token ids (tokens in), its
sampled ids and log-probs kept as they are (tokens out). ``VLLMRollout.generate_episodes`` syncs and wakes its
engine once for all of a rollout's turns (``vllm_episodes``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sgrpo.rollout.engine import stop_and_pad_ids
from sgrpo.rollout.episodes import Turn, episode_positions, run_episodes
from sgrpo.rollout.vllm_requests import _sampled_logprobs, sampling_kwargs
from sgrpo.types import Example, RolloutBatch


def vllm_episodes(
    engine,
    sampling_params: Callable[..., Any],
    engine_rng: Callable[[int | None], contextlib.AbstractContextManager],
    model: nn.Module,
    tokenizer,
    examples: Sequence[Example],
    group_size: int,
    environment,
    greedy: bool = False,
) -> RolloutBatch:
    """``group_size`` episodes per example from ``engine`` (a ``VLLMRollout``: its vLLM engine, sampling settings and
    seeds, drawn as its ``generate`` draws them: per-request seeds from torch's RNG, or one engine seed per turn
    through ``engine_rng``); ``sampling_params`` is ``vllm.SamplingParams``. Episodes end at ``max_model_len``
    (else the model's positions). A pooled engine (``tensor_parallel_size`` > 1) is refused: every process would
    have to send every turn."""
    if engine.tensor_parallel_size > 1:
        raise ValueError("multi-turn episodes need rollout.tensor_parallel_size 1 (each process its own engine)")
    llm = engine._engine(model)
    engine._ready(llm, model)
    try:
        return _episodes(engine, llm, sampling_params, engine_rng, model, tokenizer, examples, group_size,
                         environment, greedy)  # fmt: skip
    finally:
        if engine.sleep and not engine._held:
            llm.sleep(level=1)
            engine._asleep = True


def _episodes(engine, llm, sampling_params, engine_rng, model, tokenizer, examples, group_size, environment, greedy):
    eos, pad = stop_and_pad_ids(model, tokenizer)
    settings = dict(max_new_tokens=engine.max_new_tokens, temperature=engine.temperature, top_p=engine.top_p,
                    top_k=engine.top_k, stop_token_ids=eos, greedy=greedy)  # fmt: skip

    def sample(contexts: list[list[int]]) -> list[Turn]:
        draw = engine.seed_per_request and not greedy
        seeds = torch.randint(2**31 - 1, (len(contexts),), device="cpu").tolist() if draw else [None] * len(contexts)
        step_seed = None if greedy or draw else int(torch.randint(2**31 - 1, (1,), device="cpu"))
        params = [sampling_params(**sampling_kwargs(group_size=1, seed=seed, **settings)) for seed in seeds]
        with engine_rng(step_seed):
            outputs = llm.generate([{"prompt_token_ids": list(c)} for c in contexts], params, use_tqdm=False)
        turns = []
        for output in outputs:
            ids = list(output.outputs[0].token_ids)
            turns.append((ids, _sampled_logprobs(output.outputs[0].logprobs, ids), None))
        return turns

    positions = episode_positions(model, engine.max_model_len)
    device = next(model.parameters()).device
    return run_episodes(sample, tokenizer, examples, group_size, environment, eos, pad, device,
                        max_positions=positions, reports=(True, False))  # fmt: skip
