"""Tools for ``tasks.environment.ToolEnvironment``: parsing Hermes / Qwen ``<tool_call>`` JSON, JSON schemas from
typed functions, and running a call with a timeout, its failures turned into error text.

Every failure is an observation, never an exception: a malformed call, an unknown tool, arguments that do
not fit the signature, a tool that raises, runs past its timeout, returns something other than ``str``, or prints
to stdout. A call runs in a thread (the default), whose timeout fires only while the tool gives Python's
interpreter lock back: one long C call (``9**9**9**9``, a runaway regex) holds it, and the step waits for it; and
a timed-out thread is left behind (Python cannot stop one). With ``workers`` a call runs in a worker process
(``tasks.pool``) that is killed at the timeout, whatever it runs; its tools must then be importable functions.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import re
import sys
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgrpo.checks import ConfigError, require

#: how a model calls a tool (Hermes / Qwen2.5 / Qwen3 chat templates)
TOOL_CALL_FORMAT = '<tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\n</tool_call>'
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and ``arguments``, or ``error`` (what was malformed)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>`` blocks of ``text`` in order (an unclosed last block included); [] when there is none."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body.strip())
        except (ValueError, RecursionError) as err:  # RecursionError: brackets nested a thousand deep; ValueError
            # (JSONDecodeError's base) also an integer of over 4,300 digits, which Python refuses to convert
            why = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply" if isinstance(
                err, RecursionError) else "a number too long"  # fmt: skip
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({why}); write {TOOL_CALL_FORMAT}"))
            continue
        name = data.get("name") if isinstance(data, dict) else None
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(ToolCall(name if isinstance(name, str) else None,
                                  error=f'a tool call needs "name" (text) and "arguments" (an object); write '
                                        f"{TOOL_CALL_FORMAT}"))  # fmt: skip
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def _utf8(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate) as "?"."""
    return text.encode("utf-8", "replace").decode("utf-8")


def resolve_tool(tool: Callable[..., Any] | str, field_name: str = "tool") -> Callable[..., Any]:
    """A tool function, or the function at import path "module.function"."""
    if isinstance(tool, str):
        module, _, attr = tool.rpartition(".")
        require(bool(module), f"{field_name}: {tool!r} is not an import path (write module.function)")
        try:
            tool = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{field_name}: cannot import {tool!r} ({err})") from None
    require(callable(tool) and hasattr(tool, "__name__"), f"{field_name} must be a function, got {tool!r}")
    return tool


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style JSON schema of ``function`` that chat templates render: its name, its docstring's first
    paragraph, and each parameter's JSON type (from its type hint; "string" when it has none), required unless
    it has a default."""
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for name, param in inspect.signature(function).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(name, str)) or hints.get(name, str)
        properties[name] = {"type": _JSON_TYPES.get(hint, "string")}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(function) or function.__name__
    description = doc.split("\n\n")[0].replace("\n", " ")
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": function.__name__, "description": description,
                                             "parameters": parameters}}  # fmt: skip


class _ThreadStdout(io.TextIOBase):
    """``sys.stdout`` while tools run: writes from a tool's thread go to its buffer, the rest to the real stdout."""

    def __init__(self, real) -> None:
        self.real, self.buffers = real, {}

    def write(self, text: str) -> int:
        buffer = self.buffers.get(threading.get_ident())
        return buffer.write(text) if buffer is not None else self.real.write(text)

    def flush(self) -> None:
        self.real.flush()


class _Capture:
    """One ``_ThreadStdout`` in ``sys.stdout`` while any tool runs (calls may overlap in threads): installed by the
    first, removed by the last."""

    def __init__(self) -> None:
        self.lock, self.users, self.proxy = threading.Lock(), 0, None

    def __enter__(self) -> _ThreadStdout:
        with self.lock:
            if self.users == 0:
                self.proxy = _ThreadStdout(sys.stdout)
                sys.stdout = self.proxy
            self.users += 1
            return self.proxy

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                sys.stdout = self.proxy.real


_CAPTURE = _Capture()


class ToolRunner:
    """Runs ``ToolCall``s with a ``timeout`` (seconds), in a thread or, with ``workers``, in one of that many
    worker processes (killed at the timeout); each call's reply is (text, failed)."""

    def __init__(self, timeout: float = 5.0, max_output_chars: int = 2000, workers: int = 0) -> None:
        self.timeout, self.max_output_chars, self.workers = timeout, max_output_chars, workers

    def run(self, call: ToolCall, tools: dict[str, Callable[..., Any]]) -> tuple[str, bool]:
        """One call's (text, failed)."""
        (reply,) = self.run_all([call], tools)
        return reply

    def run_all(self, calls: list[ToolCall], tools: dict[str, Callable[..., Any]]) -> list[tuple[str, bool]]:
        """Each call's (text, failed), in order. With ``workers`` the calls go to the worker pool together, so that
        many run at once, each with its own timeout and failure; in threads they run one after another."""
        replies: list[tuple[str, bool] | None] = [self._refusal(call, tools) for call in calls]
        runnable = [i for i, reply in enumerate(replies) if reply is None]
        if self.workers and runnable:
            from tasks.pool import get_pool

            jobs = [(tools[calls[i].name], calls[i].arguments) for i in runnable]
            for i, outcome in zip(runnable, get_pool(self.workers).run(_call_tool, jobs, self.timeout)):
                hung = not outcome.ok and outcome.error.startswith("timeout")
                result = outcome.value if outcome.ok else ({} if hung else {"error": outcome.error}, "")
                replies[i] = self._reply(calls[i].name, hung, *result)
        else:
            for i in runnable:
                replies[i] = self._in_thread(calls[i], tools[calls[i].name])
        # cut to max_output_chars (refusals echo model-written names and arguments too), and UTF-8 text only: a
        # lone surrogate (printed by a tool, or given in a call's JSON) made the tokenizer raise and stopped the run
        return [(_utf8(text[: self.max_output_chars]), failed) for text, failed in replies]  # type: ignore[misc]

    def _refusal(self, call: ToolCall, tools: dict[str, Callable[..., Any]]) -> tuple[str, bool] | None:
        """The error reply of a call that cannot run (malformed, an unknown tool, wrong arguments), else None."""
        if call.error is not None:
            return f"Error: {call.error}", True
        function = tools.get(call.name)
        if function is None:
            return f"Error: there is no tool {call.name!r}; the tools are {', '.join(sorted(tools))}", True
        try:
            inspect.signature(function).bind(**call.arguments)
        except TypeError as err:
            return f"Error: wrong arguments for {call.name}: {err}", True
        return None

    def _in_thread(self, call: ToolCall, function: Callable[..., Any]) -> tuple[str, bool]:
        """The call in a thread, joined for at most ``timeout`` seconds, what it prints caught."""
        result: dict[str, Any] = {}
        printed = io.StringIO()

        def target() -> None:
            capture.buffers[threading.get_ident()] = printed
            try:
                result["value"] = function(**call.arguments)
            except BaseException as err:  # noqa: BLE001 (sys.exit in a tool is the tool's failure, not the run's end)
                result["error"] = f"{type(err).__name__}: {err}"

        with _CAPTURE as capture:
            thread = threading.Thread(target=target, name=f"sgrpo-tool-{call.name}", daemon=True)
            thread.start()
            thread.join(self.timeout)
        return self._reply(call.name, thread.is_alive(), result, printed.getvalue())

    def _reply(self, name: str, hung: bool, result: dict[str, Any], printed: str) -> tuple[str, bool]:
        if hung:
            return f"Error: tool {name} did not return within {self.timeout:g} s", True
        if "error" in result:
            return f"Error: tool {name} raised {result['error']}"[: self.max_output_chars], True
        if printed:
            return f"Error: tool {name} printed to stdout instead of returning its output as text", True
        value = result.get("value")
        if not isinstance(value, str):
            return f"Error: tool {name} returned {type(value).__name__}, not text (a tool returns a str)", True
        return value[: self.max_output_chars], False


def _call_tool(function: Callable[..., Any], arguments: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A tool call in a worker process: ({"value": ...} or {"error": ...}, what it printed)."""
    printed = io.StringIO()
    result: dict[str, Any] = {}
    with contextlib.redirect_stdout(printed):
        try:
            result["value"] = function(**arguments)
        except BaseException as err:  # noqa: BLE001 (sys.exit in a tool is the tool's failure)
            result["error"] = f"{type(err).__name__}: {err}"
    return result, printed.getvalue()
