"""Multi-turn episodes: an ``Environment`` answers each model turn with an ``Observation``; ``ToolEnvironment``
runs plain typed Python functions as tools.

An episode opens with ``Environment.start(example)`` (by default the example's prompt as chat messages); the
model writes a turn; ``Environment.step(example, messages)`` gets the conversation so far, ending with that
turn, and returns the messages appended after it (role "tool" or "user"), an optional per-turn reward (added
to the task's reward of the episode) and whether the episode is done. The episode also ends after
``max_turns`` model turns, or when its tokens after the opening reach ``max_episode_tokens``. The task's
reward scores the episode's final assistant message, so every existing reward works unchanged.

The rollout engine (``sgrpo.rollout.episodes``) keeps the model's tokens verbatim and appends each observation
as the chat template renders it (docs/environments.md). Plugged in by ``class_path`` under ``model.environment``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgrpo.checks import require
from sgrpo.types import Example, Messages
from tasks.pool import require_picklable
from tasks.tools import TOOL_CALL_FORMAT, ToolRunner, parse_tool_calls, resolve_tool, tool_schema


@dataclass(frozen=True)
class Observation:
    """What an environment answers to one model turn.

    ``messages``: appended after the model's turn (role "tool" or "user"); [] when done. ``reward``: an optional
    per-turn reward, added to the task's reward of the episode. ``done``: the episode ends here.
    ``tool_calls`` / ``tool_failures``: the turn's tool calls and how many of them failed (logged as
    ``train/episode/tool_calls`` and ``train/episode/tool_failures``).
    """

    messages: Messages
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_failures: int = 0


class Environment(ABC):
    """Answers the model's turns of an episode (module docstring).

    Subclasses implement ``step``; ``start`` defaults to the example's prompt (a raw-text prompt becomes one user
    message). ``max_turns``: model turns per episode at most; ``max_episode_tokens``: tokens after the opening
    (generated and observation) per episode at most (None: no limit but the model's positions).
    ``observation_role``: the role of the messages ``step`` returns, used to check at start that the chat
    template can render them after an assistant turn. ``template_kwargs`` go to every rendering of the
    episode's conversation (``ToolEnvironment``: the tools' schemas). ``concurrent_steps``: how many episodes'
    ``step`` may run at once in threads (1, the default: one after another). An environment may also define
    ``steps(turns)``, the observations of one round's (example, messages) turns in order, or None to leave them to
    ``step`` (``ToolEnvironment`` with ``tool_workers``: the round's calls go to its worker pool together).
    """

    max_turns: int = 4
    max_episode_tokens: int | None = None
    observation_role: str = "user"
    #: episodes whose ``step`` runs at once, in threads (1: one after another); raise it for a thread-safe ``step``
    #: that waits (on tools, a server)
    concurrent_steps: int = 1

    def __init__(self, max_turns: int = 4, max_episode_tokens: int | None = None) -> None:
        require(max_turns >= 1, f"max_turns must be >= 1, got {max_turns}")
        require(max_episode_tokens is None or max_episode_tokens >= 1, "max_episode_tokens must be >= 1 or null")
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens

    def start(self, example: Example) -> Messages:
        """The episode's opening messages: by default the example's prompt."""
        prompt = example.prompt
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    @abstractmethod
    def step(self, example: Example, messages: Messages) -> Observation:
        """The answer to the model's turn: ``messages`` is the conversation so far, ending with that turn."""

    def template_kwargs(self, example: Example) -> Mapping[str, Any]:
        """Extra keyword arguments of the chat template for this episode (besides the example's own)."""
        return {}

    def adapt_to_tokenizer(self, tokenizer) -> None:  # noqa: B027 (a hook; most environments need none)
        """Called once with the tokenizer the policy samples with, before any episode."""

    @property
    def name(self) -> str:
        return type(self).__name__


class ToolEnvironment(Environment):
    """Tools as plain typed Python functions: the model calls them in the chat template's own format, Hermes /
    Qwen style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and reads their output.

    Each ``tools`` entry is a function (or its "module.function" import path) with type-hinted parameters that
    returns text; its docstring's first line describes it. The tools' JSON schemas reach the chat template as
    ``tools=[...]`` when the template renders tools; otherwise a system message lists them with the call format.
    A turn without a tool call ends the episode (the model has answered); each call gets one "tool" message:
    the tool's output, or an error (an unknown tool, malformed JSON or arguments, a tool that raises, runs
    past ``tool_timeout`` seconds, returns something other than text, or prints), counted in ``tool_failures``
    and the episode goes on. At most ``max_calls_per_turn`` calls run per turn; outputs are cut to
    ``max_output_chars`` characters. The last allowed turn (``max_turns``) runs no tools. ``concurrent_steps``
    episodes run their calls at once (threads: for tools that wait, and that are thread-safe). ``tool_workers``
    runs each call in one of that many worker processes instead, killed at ``tool_timeout`` even inside one long C
    call (a thread's timeout cannot end that); its tools must be importable functions (one that does not pickle is
    refused). The calls of one round (every episode's turn, ``steps``) then go to the workers together, that many
    at once.
    """

    observation_role = "tool"

    def __init__(
        self,
        tools: Sequence[Callable[..., str] | str],
        max_turns: int = 4,
        tool_timeout: float = 5.0,
        max_episode_tokens: int | None = None,
        max_calls_per_turn: int = 8,
        max_output_chars: int = 2000,
        system_prompt: str | None = None,
        concurrent_steps: int = 1,
        tool_workers: int = 0,
    ) -> None:
        super().__init__(max_turns, max_episode_tokens)
        require(concurrent_steps >= 1, f"concurrent_steps must be >= 1, got {concurrent_steps}")
        self.concurrent_steps = concurrent_steps
        require(len(tools) >= 1, "tools must name at least one function")
        require(tool_timeout > 0, f"tool_timeout must be > 0 seconds, got {tool_timeout}")
        require(max_calls_per_turn >= 1, f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        require(max_output_chars >= 1, f"max_output_chars must be >= 1, got {max_output_chars}")
        functions = [resolve_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
        self.tools: dict[str, Callable[..., Any]] = {}
        for f in functions:
            require(f.__name__ not in self.tools, f"tools: two tools are named {f.__name__!r}")
            self.tools[f.__name__] = f
        self.schemas = [tool_schema(f) for f in functions]
        require(tool_workers >= 0, f"tool_workers must be >= 0 (0: threads), got {tool_workers}")
        for name, function in self.tools.items() if tool_workers else ():
            require_picklable(function, f"tools: {name}", "set tool_workers: 0 (threads)")
        self.runner = ToolRunner(tool_timeout, max_output_chars, tool_workers)
        self.tool_timeout, self.max_calls_per_turn = tool_timeout, max_calls_per_turn
        self.max_output_chars = max_output_chars
        self.system_prompt = system_prompt
        self.template_renders_tools = False  # set by adapt_to_tokenizer

    def adapt_to_tokenizer(self, tokenizer) -> None:
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_renders_tools = isinstance(template, str) and "tools" in template

    def template_kwargs(self, example: Example) -> Mapping[str, Any]:
        return {"tools": self.schemas} if self.template_renders_tools else {}

    def start(self, example: Example) -> Messages:
        messages = super().start(example)
        if self.template_renders_tools and self.system_prompt is None:
            return messages
        text = self.system_prompt if self.system_prompt is not None else self.tools_prompt()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def tools_prompt(self) -> str:
        """The system message that lists the tools when the chat template does not render them."""
        import json

        listed = "\n".join(json.dumps(s["function"]) for s in self.schemas)
        return f"You may call these tools:\n{listed}\nTo call one, write {TOOL_CALL_FORMAT}"

    def step(self, example: Example, messages: Messages) -> Observation:
        return self._answer([(example, messages)])[0]

    def steps(self, turns: Sequence[tuple[Example, Messages]]) -> list[Observation] | None:
        """``step`` of one round's turns (example, conversation) of several episodes, in order, their tool calls sent
        to the ``tool_workers`` pool together, so that many run at once. None (the episode loop then calls ``step``
        per episode, ``concurrent_steps`` at once) without ``tool_workers`` or for a subclass's own ``step``."""
        if not self.runner.workers or type(self).step is not ToolEnvironment.step:
            return None
        return self._answer(turns)

    def _answer(self, turns: Sequence[tuple[Example, Messages]]) -> list[Observation]:
        """Each turn's observation, the tool calls of all the turns run by one ``ToolRunner.run_all``."""
        planned = [self._calls(example, messages) for example, messages in turns]
        replies = iter(self.runner.run_all([call for calls in planned for call in calls or []], self.tools))
        observations = []
        for calls in planned:
            if calls is None:
                observations.append(Observation([], done=True))
                continue
            messages, failures = [], 0
            for call in calls:
                text, failed = next(replies)
                failures += failed
                messages.append({"role": "tool", "name": call.name or "", "content": text})
            observations.append(Observation(messages, tool_calls=len(messages), tool_failures=failures))
        return observations

    def _calls(self, example: Example, messages: Messages) -> list | None:
        """The calls of the conversation's last turn to run (at most ``max_calls_per_turn``); None: the episode ends
        (the turn calls no tool, or it is the last allowed turn)."""
        opening = self.start(example)  # a few-shot prompt's own assistant messages are not the model's turns
        turns = sum(m["role"] == "assistant" for m in messages[len(opening) :])
        calls = parse_tool_calls(messages[-1]["content"])
        if not calls or turns >= self.max_turns:
            return None
        return calls[: self.max_calls_per_turn]
