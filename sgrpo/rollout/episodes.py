"""Multi-turn episodes, tokens in and tokens out: G episodes per example, the turns of every running episode
sampled together, the model's tokens kept verbatim.

An environment (``tasks.environment.Environment``, used here by its methods only: rollout sits below tasks)
opens each episode and answers each model turn. A trajectory is a list of rows; a row is its prompt ids (the
opening as the chat template renders it) then its completion region: the model's turns, each the sampled ids
verbatim with their sampler log-probs (loss mask 1, up to and including the end-of-turn token), and between
them the observations (mask 0, attended). After every turn the whole conversation is rendered again and
checked at the text level: when the rendering still starts with the row's text so far (its prompt, then the
decoded turns and observations), only the new part is tokenized and appended, so the row is what the sampler
saw; when it does not (a template that strips earlier ``<think>`` blocks, or that re-formats a turn), the
episode goes on in a new row whose prompt is that rendering, and nothing already sampled is re-tokenized.
The next turn is sampled from the row's own ids, so the trainer's log-probs at mask-1 tokens are the
sampler's (docs/environments.md).

Limits: ``environment.max_turns`` model turns; ``environment.max_episode_tokens`` tokens after the opening
(generated and observation); the model's positions. A turn cut by a limit, or an observation that leaves no
room for another turn (it is then not appended), ends the episode (truncated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgrpo.rollout.engine import left_padded
from sgrpo.types import Episode, Example, Messages, RolloutBatch

#: (prompt ids [U, P], prompt mask [U, P], row -> prompt [R]) -> (tokens [R, T], log-probs or None, masses or None)
#: (prompt ids, their mask, each row's prompt, at most this many new tokens or None: the engine's own) -> new tokens
GenerateRows = Callable[[Tensor, Tensor, Tensor, "int | None"], tuple[Tensor, Tensor | None, Tensor | None]]
#: one sampled turn: its token ids (a stop token ends it; padding after it is cut), their log-probs, their nucleus
#: masses (each None where the sampler has none)
Turn = tuple[list[int], list[float] | None, list[float] | None]
#: the contexts (token ids) of the running episodes -> one turn for each: how an engine plugs into the episode loop
#: (the list is a ``Contexts``: ``contexts.episodes`` names each context's episode)
SampleTurns = Callable[[list[list[int]]], list[Turn]]


class Contexts(list):
    """The running episodes' contexts (token id lists) handed to ``SampleTurns``, and ``episodes``: each context's
    episode (its index in the rollout, the same at every turn), for an engine that sends an episode's turns to one
    server (its prefix cache: ``sgrpo.rollout.vllm_server_episodes``)."""

    def __init__(self, contexts: list[list[int]], episodes: list[int]) -> None:
        super().__init__(contexts)
        self.episodes = episodes


class EpisodeError(RuntimeError):
    """An environment raised (or returned something that is not an ``Observation``): the step fails, naming it."""


def render(tokenizer, messages: Messages, kwargs: Mapping[str, Any], generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def multi_turn_problem(tokenizer, environment, chat_template_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """Why ``tokenizer``'s chat template cannot run ``environment``'s episodes, or None.

    It needs a chat template that renders a conversation of the opening, an assistant turn and an observation
    (the environment's ``observation_role``) with both turns' text in it, in order.
    """
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template, so an episode's turns cannot be rendered"
    role = getattr(environment, "observation_role", "user")
    probe = [{"role": "user", "content": "Probe question 17"}, {"role": "assistant", "content": "Probe answer 23"},
             {"role": role, "content": "Probe observation 29"}]  # fmt: skip
    kwargs = dict(chat_template_kwargs or {})
    try:
        text = render(tokenizer, probe, kwargs)
    except Exception as err:  # noqa: BLE001 (any template error is the answer)
        return f"its chat template cannot render a {role!r} message after an assistant turn ({describe(err)})"
    if not 0 <= text.find("Probe answer 23") < text.find("Probe observation 29"):
        return f"its chat template drops the assistant turn or the {role!r} message of a conversation"
    return None


@dataclass
class _Row:
    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    masses: list[float] = field(default_factory=list)

    def extend(self, ids: list[int], generated: bool, logprobs: list[float] | None = None,
               masses: list[float] | None = None) -> None:  # fmt: skip
        self.completion += ids
        self.mask += [generated] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.masses += masses if masses is not None else [0.0] * len(ids)


@dataclass
class _Trajectory:
    example: Example
    messages: Messages
    kwargs: dict[str, Any]
    rows: list[_Row]
    text: str  # the current row's text: its rendered prompt, then the decoded turns and observations
    final: list[int] = field(default_factory=list)  # the last model turn's ids
    rewards: list[float | None] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    done: bool = False
    truncated: bool = False

    def context(self) -> list[int]:
        return self.rows[-1].prompt + self.rows[-1].completion


_COUNTS = ("turns", "tool_calls", "tool_failures", "generated_tokens", "observation_tokens", "forks")


def run_episodes(
    sample_turns: SampleTurns,
    tokenizer,
    examples: Sequence[Example],
    group_size: int,
    environment,
    eos: Sequence[int],
    pad: int,
    device: torch.device,
    max_batch_rows: int = 512,
    max_positions: int | None = None,
    *,
    reports: tuple[bool, bool],
) -> RolloutBatch:
    """``group_size`` episodes of ``environment`` per example as a ``RolloutBatch`` (module docstring); each turn of
    up to ``max_batch_rows`` running episodes at a time from ``sample_turns`` (``batched_turns`` for a decoder).

    ``reports``: (log-probs, nucleus masses), what the engine's sampler returns with every turn (a turn without
    them, or with others, is an error). The batch carries exactly those fields, also where no episode took a turn
    (every opening beyond the positions), so that every process's batch has the same fields and the collectives
    on them pair up."""
    trajectories = [_open(tokenizer, ex, environment) for ex in examples for _ in range(group_size)]
    index = {id(t): i for i, t in enumerate(trajectories)}
    budget = getattr(environment, "max_episode_tokens", None)
    while True:
        running = [t for t in trajectories if not t.done]
        for t in running:  # no room for a token: the episode ends before sampling
            if _room(t, budget, max_positions) < 1:
                t.done = t.truncated = True
        running = [t for t in running if not t.done]
        if not running:
            break
        for start in range(0, len(running), max_batch_rows):
            chunk = running[start : start + max_batch_rows]
            turns = sample_turns(Contexts([t.context() for t in chunk], [index[id(t)] for t in chunk]))
            for t, (ids, logprobs, masses) in zip(chunk, turns):
                if (logprobs is not None, masses is not None) != reports:
                    raise ValueError(f"the sampler returned a turn with (log-probs, nucleus masses) "
                                     f"{(logprobs is not None, masses is not None)}, not the {reports} its engine "
                                     "reports")  # fmt: skip
                _take_turn(tokenizer, t, ids, logprobs, masses, eos, budget, max_positions)
        answering = [t for t in running if not t.done]
        for t, observation in zip(answering, _steps(environment, answering)):
            _answer(tokenizer, t, environment, observation, budget, max_positions)
    return _batch(tokenizer, trajectories, group_size, pad, device, reports)


def _open(tokenizer, example: Example, environment) -> _Trajectory:
    messages, kwargs, text = _opening(tokenizer, example, environment)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return _Trajectory(example, messages, kwargs, [_Row(ids)], text)


def _opening(tokenizer, example: Example, environment) -> tuple[Messages, dict[str, Any], str]:
    """An episode's opening messages (``environment.start``), its template's keyword arguments, its text."""
    messages = _call(environment, "start", example)
    kwargs = {**example.chat_template_kwargs, **environment.template_kwargs(example)}
    return messages, kwargs, _render(tokenizer, environment, messages, kwargs, 0)


def opening_text(tokenizer, example: Example, environment) -> str:
    """The text an episode of ``environment`` on ``example`` starts from: its opening through the chat template, with
    what the environment adds (a tool environment's system message or ``tools=`` schemas). The prompt screen
    (``sgrpo.rollout.prompt_limits.within_limit``) measures this, not the example's prompt alone."""
    return _opening(tokenizer, example, environment)[2]


def _room(t: _Trajectory, budget: int | None, max_positions: int | None) -> int:
    """Tokens the episode may still add (its budget, the model's positions)."""
    room = float("inf")
    if budget is not None:
        room = budget - t.counts["generated_tokens"] - t.counts["observation_tokens"]
    if max_positions is not None:
        room = min(room, max_positions - len(t.context()))
    return int(min(room, 2**62))


def episode_positions(model, max_model_len: int | None) -> int | None:
    """The positions an episode's row may fill: an engine's ``max_model_len``, else the model's positions."""
    if max_model_len is not None:
        return max_model_len
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def batched_turns(generate_rows: GenerateRows, pad: int, device: torch.device, max_new_tokens: int | None = None,
                  max_positions: int | None = None) -> SampleTurns:  # fmt: skip
    """``SampleTurns`` of a batch decoder (``HFRollout``): the contexts left-padded into one batch, identical ones
    (an example's G openings) prefilled once. With ``max_positions``, a context with less room than
    ``max_new_tokens`` is decoded in a batch of its own limit (those of one limit together): a decoder asked for
    more would run past the model's positions (an index error for learned positions, wasted steps for RoPE)."""

    def batch(contexts: list[list[int]], limit: int | None) -> list[Turn]:
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]
        ids, mask = left_padded(list(distinct), pad, device)
        tokens, logprobs, masses = generate_rows(ids, mask, torch.tensor(row_prompt, device=device), limit)
        rows = tokens.tolist()
        lp = logprobs.float().tolist() if logprobs is not None else [None] * len(rows)
        ms = masses.float().tolist() if masses is not None else [None] * len(rows)
        return list(zip(rows, lp, ms))

    def sample(contexts: list[list[int]]) -> list[Turn]:
        if max_positions is None or max_new_tokens is None:
            return batch(contexts, None)
        limits = [max(1, min(max_new_tokens, max_positions - len(c))) for c in contexts]
        if min(limits) == max_new_tokens:
            return batch(contexts, None)
        turns: list[Turn | None] = [None] * len(contexts)
        for limit in sorted(set(limits), reverse=True):
            at = [i for i, n in enumerate(limits) if n == limit]
            for i, turn in zip(at, batch([contexts[i] for i in at], limit)):
                turns[i] = turn
        return turns

    return sample


def _take_turn(tokenizer, t: _Trajectory, ids: list[int], logprobs, masses, eos: Sequence[int], budget,
               max_positions) -> None:  # fmt: skip
    """Append the sampled turn (cut at its end-of-turn token, or at the episode's room) to the current row."""
    stop = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
    room = _room(t, budget, max_positions)
    keep = min(stop or len(ids), room)
    ended = stop is not None and stop <= room
    ids = ids[:keep]
    cut = lambda values: None if values is None else values[:keep]  # noqa: E731
    t.rows[-1].extend(ids, True, cut(logprobs), cut(masses))
    t.final = ids
    t.counts["turns"] += 1
    t.counts["generated_tokens"] += keep
    body = ids[:-1] if ended else ids  # without the end-of-turn token, which the template writes itself
    t.messages = [*t.messages, {"role": "assistant", "content": tokenizer.decode(body, skip_special_tokens=False)}]
    t.text += tokenizer.decode(ids, skip_special_tokens=False)
    if not ended:  # cut by max_new_tokens or the episode's room: the turn is incomplete, the episode ends
        t.done = t.truncated = True


def _steps(environment, trajectories: list[_Trajectory]) -> list:
    """``environment.step`` of each trajectory's last turn, in order: all of them in one ``environment.steps`` where the
    environment answers a round together (``ToolEnvironment``'s worker pool), else ``concurrent_steps`` at once in
    threads where the environment allows it (its steps wait on tools), else one after another."""
    calls = [(t.example, [dict(m) for m in t.messages]) for t in trajectories]
    together = _call(environment, "steps", calls) if callable(getattr(environment, "steps", None)) else None
    if together is not None:
        if len(together) != len(calls):
            raise EpisodeError(f"environment {_name(environment)} returned {len(together)} observations from "
                               f"steps() for {len(calls)} turns: return one per turn, in order")  # fmt: skip
        return list(together)
    workers = min(int(getattr(environment, "concurrent_steps", 1)), len(calls))
    if workers <= 1:
        return [_call(environment, "step", *call) for call in calls]
    with ThreadPoolExecutor(workers, thread_name_prefix="sgrpo-env") as pool:
        return list(pool.map(lambda call: _call(environment, "step", *call), calls))


def _answer(tokenizer, t: _Trajectory, environment, observation, budget: int | None, max_positions: int | None) -> None:
    """The environment's answer to the last turn, appended to the row (or a new row where the template breaks)."""
    problem = observation_problem(observation)
    if problem is not None:
        raise EpisodeError(f"environment {_name(environment)} returned {problem} "
                           f"from step(): return tasks.environment.Observation(messages, reward, done)")  # fmt: skip
    t.rewards.append(None if observation.reward is None else float(observation.reward))
    t.counts["tool_calls"] += int(getattr(observation, "tool_calls", 0))
    t.counts["tool_failures"] += int(getattr(observation, "tool_failures", 0))
    if observation.done or not observation.messages or t.counts["turns"] >= environment.max_turns:
        t.done = True
        return
    messages = [*t.messages, *observation.messages]
    rendered = _render(tokenizer, environment, messages, t.kwargs, t.counts["turns"])
    extends = rendered.startswith(t.text)  # else the template re-rendered earlier turns (stripped thinking)
    if extends:  # tokenize only what is new
        ids = tokenizer(rendered[len(t.text) :], add_special_tokens=False)["input_ids"]
        added, context = len(ids), len(t.context()) + len(ids)
    else:  # a new row of the same trajectory opening with the rendering: nothing sampled is re-tokenized
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        so_far = _render(tokenizer, environment, t.messages, t.kwargs, t.counts["turns"], False)
        so_far = tokenizer(so_far, add_special_tokens=False)["input_ids"]
        # the observations' share of the new prompt; at least their contents' tokens: a template that strips the
        # last turn's thinking once a message follows it (Qwen3's) shortens the rest by as much, which read as 0
        own = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in observation.messages)
        added, context = max(len(ids) - len(so_far), own), len(ids)
    used = t.counts["generated_tokens"] + t.counts["observation_tokens"] + added
    if (budget is not None and used >= budget) or (max_positions is not None and context >= max_positions):
        t.done = t.truncated = True  # no room for the observation and a turn after it: the episode ends here
        return
    if extends:
        t.rows[-1].extend(ids, False)
    else:
        t.rows.append(_Row(ids))
        t.counts["forks"] += 1
    t.counts["observation_tokens"] += added
    t.messages, t.text = messages, rendered


def observation_problem(observation) -> str | None:
    """What is wrong with what ``step`` returned, or None: messages must be a list of {"role": str, "content": str}
    dicts (the content UTF-8 text), the reward None or a finite number."""
    messages = getattr(observation, "messages", None)
    if not isinstance(messages, list) or not hasattr(observation, "done"):
        return f"{type(observation).__name__}, not an Observation"
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"the message {m!r}, not a dict with text role and content"
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: the tokenizer refuses it with a bare TypeError
            return f"a message whose content is not UTF-8 text ({err.reason} at character {err.start})"
    reward = getattr(observation, "reward", None)
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        return f"the reward {reward!r}, not a finite number or None"
    return None


def _call(environment, method: str, *args):
    try:
        return getattr(environment, method)(*args)
    except Exception as err:
        raise EpisodeError(f"environment {_name(environment)} failed in {method}(): {describe(err)}") from err


def _render(tokenizer, environment, messages: Messages, kwargs: Mapping[str, Any], turns: int,
            generation_prompt: bool = True) -> str:  # fmt: skip
    """``render`` inside an episode: a template that refuses the conversation (jinja's ``TemplateError``, a
    template's ``raise_exception``) is an ``EpisodeError`` naming the environment and the turn."""
    try:
        return render(tokenizer, messages, kwargs, generation_prompt)
    except Exception as err:  # noqa: BLE001 - whatever the template raises
        where = f"after turn {turns}" if turns else "at its opening"
        raise EpisodeError(f"the chat template cannot render environment {_name(environment)}'s conversation {where} "
                           f"({describe(err)}): return messages the template accepts") from err  # fmt: skip


def _name(environment) -> str:
    return getattr(environment, "name", type(environment).__name__)


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _batch(tokenizer, trajectories: list[_Trajectory], group_size: int, pad: int, device,
           reports: tuple[bool, bool]) -> RolloutBatch:  # fmt: skip
    rows = [(i, row) for i, t in enumerate(trajectories) for row in t.rows if row.completion or len(t.rows) == 1]
    p = max(len(row.prompt) for _, row in rows)
    width = max(1, max(len(row.completion) for _, row in rows))
    n = len(rows)
    input_ids = torch.full((n, p + width), pad, dtype=torch.long, device="cpu")
    attention = torch.zeros(n, p + width, dtype=torch.long, device="cpu")
    mask = torch.zeros(n, width, dtype=torch.bool, device="cpu")
    logprobs, masses = (torch.zeros(n, width, dtype=torch.float32, device="cpu") for _ in range(2))
    for r, (_, row) in enumerate(rows):
        a, c = len(row.prompt), len(row.completion)
        input_ids[r, p - a : p] = torch.tensor(row.prompt, dtype=torch.long, device="cpu")
        input_ids[r, p : p + c] = torch.tensor(row.completion, dtype=torch.long, device="cpu")
        attention[r, p - a : p + c] = 1
        mask[r, :c] = torch.tensor(row.mask, dtype=torch.bool, device="cpu")
        logprobs[r, :c] = torch.tensor(row.logprobs, dtype=logprobs.dtype, device="cpu")
        masses[r, :c] = torch.tensor(row.masses, dtype=masses.dtype, device="cpu")
    episodes = [Episode(t.messages, t.rewards, **t.counts) for t in trajectories]
    forked = n != len(trajectories)
    with_logprobs, with_masses = reports
    return RolloutBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        completion_mask=mask.to(device),
        completions=tokenizer.batch_decode([t.final for t in trajectories], skip_special_tokens=True),
        truncated=torch.tensor([t.truncated for t in trajectories], device=device),
        group_size=group_size,
        logprobs=logprobs.to(device) if with_logprobs else None,
        nucleus_mass=masses.to(device) if with_masses else None,
        trajectory=torch.tensor([i for i, _ in rows], device=device) if forked else None,
        episodes=episodes,
    )
