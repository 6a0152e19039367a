"""Multi-turn episodes from vLLM servers (``VLLMServerRollout``): the episode loop of ``sgrpo.rollout.episodes``, each
turn of every running episode one ``/inference/v1/generate`` request of one sample whose prompt is the row's own
token ids (tokens in), its sampled ids and the sampler's log-probs kept as they are (tokens out).

The weights are pushed once, before the first turn (``VLLMServerRollout.ready``: every process together), and every
answer must come from them: a server that restarted or was given other weights mid-rollout raises naming its URL.
The turns of all running episodes go out together (``max_concurrency`` requests in flight), so processes may run
different numbers of turns (no collective per turn). Each episode's turns go to the server that answered its first
turn, whose prefix cache (``--enable-prefix-caching``: on by default in vLLM's V1 engine) holds the earlier turns:
a turn then prefills only its new tokens (the observation and the generation prompt). The first turns go by
least-outstanding routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sgrpo.rollout.engine import stop_and_pad_ids
from sgrpo.rollout.episodes import Turn, episode_positions, run_episodes
from sgrpo.rollout.vllm_http import Answer, ServerError
from sgrpo.types import Example, RolloutBatch

#: vLLM's token-in token-out endpoint (``sgrpo.rollout.vllm_server.GENERATE``; that module imports this one)
GENERATE = "/inference/v1/generate"


def server_episodes(engine, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, environment,
                    greedy: bool = False) -> RolloutBatch:  # fmt: skip
    """``group_size`` episodes of ``environment`` per example from ``engine`` (a ``VLLMServerRollout``): its servers,
    sampling settings and timeouts. Each request's seed is drawn from torch's RNG (as ``generate`` draws them: a
    run reproduces); greedy asks for temperature 0. A turn asks for at most ``max_new_tokens``, and never more than
    the row's room in ``max_model_len`` (else the model's positions), where the episode ends."""
    eos, pad = stop_and_pad_ids(model, tokenizer)
    positions = episode_positions(model, engine.max_model_len)
    engine.ready(model)  # every process together: the push's gathers are collectives
    route: dict[int, str] = {}  # episode -> the server that answered its first turn (its prefix cache)

    def sample(contexts: list[list[int]]) -> list[Turn]:
        episodes = getattr(contexts, "episodes", None)  # run_episodes' Contexts: each context's episode
        draw = not greedy
        seeds = torch.randint(2**31 - 1, (len(contexts),), device="cpu").tolist() if draw else [None] * len(contexts)
        payloads = engine.request_payloads(contexts, seeds, 1, eos, greedy)
        if positions is not None:  # never past the servers' max_model_len (a request past it is refused)
            for payload, context in zip(payloads, contexts):
                room = max(positions - len(context), 1)
                payload["sampling_params"]["max_tokens"] = min(engine.max_new_tokens, room)
        urls = None if episodes is None else [route.get(e) for e in episodes]
        answers = engine.pool.map(GENERATE, payloads, workers=engine.max_concurrency, urls=urls)
        if episodes is not None:
            for e, answer in zip(episodes, answers):
                route.setdefault(e, answer.url)
        return [_turn(answer, engine._pushed) for answer in answers]

    device = next(model.parameters()).device
    # every running episode's turn at once (the pool keeps max_concurrency requests in flight)
    return run_episodes(sample, tokenizer, examples, group_size, environment, eos, pad, device,
                        max_batch_rows=2**30, max_positions=positions, reports=(True, False))  # fmt: skip


def _turn(answer: Answer, pushed: str | None) -> Turn:
    """One answer's sample: its token ids and the sampler's log-probs of them (the request asks for them)."""
    choices = (answer.body or {}).get("choices") if isinstance(answer.body, dict) else None
    if not choices:
        raise ServerError(f"{answer.url}: answered without choices: {str(answer.body)[:200]}")
    choice: dict[str, Any] = choices[0]
    spans = {s["version"] for s in choice.get("weight_versions") or []}
    if pushed is not None and spans and spans != {pushed}:
        raise ServerError(f"{answer.url}: sampled a turn with weight versions {sorted(spans)}, not the {pushed} "
                          "pushed: did the server restart, or another trainer push, during the rollout?")  # fmt: skip
    ids = [int(i) for i in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise ServerError(f"{answer.url}: answered without the sampled tokens' log-probs, which the request asks for "
                          "(sampling_params.logprobs 0): is it a vLLM server?")  # fmt: skip
    if len(content) != len(ids) or any(int(c["token_id"]) != i for c, i in zip(content, ids)):
        raise ServerError(f"{answer.url}: the log-probs do not match the sampled token ids")
    return ids, [float(c["logprob"]) for c in content], None
