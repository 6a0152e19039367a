"""ToolEnvironment: Hermes / Qwen tool calls parsed, tools run with a timeout, every failure an observation."""

from __future__ import annotations

import json
import time

import pytest

from sgrpo.checks import ConfigError
from sgrpo.types import Example
from tasks.environment import Observation, ToolEnvironment
from tasks.tools import parse_tool_calls, tool_schema

EXAMPLE = Example("what is 1234 * 5678", "7006652")


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
    """
    return str(a * b)


def raises(x: int) -> str:
    return str(1 // (x - x))


def hangs() -> str:
    time.sleep(30)
    return "late"


def number() -> str:
    return 42  # type: ignore[return-value]


def prints() -> str:
    print("the answer is 42")
    return "42"


def exits() -> str:
    raise SystemExit(3)


def echo(text: str) -> str:
    return text


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env: ToolEnvironment, text: str, turns: int = 1) -> Observation:
    messages = env.start(EXAMPLE)
    messages += [{"role": "assistant", "content": "earlier"}] * (turns - 1) + [{"role": "assistant", "content": text}]
    return env.step(EXAMPLE, messages)


@pytest.fixture
def env() -> ToolEnvironment:
    return ToolEnvironment([multiply, raises, hangs, number, prints, exits, echo], max_turns=3, tool_timeout=0.2)


def test_a_tool_call_runs_and_its_output_is_the_observation(env):
    obs = step(env, "I will compute. " + call("multiply", a=1234, b=5678) + call("multiply", a=2, b=3))
    assert obs == Observation([{"role": "tool", "name": "multiply", "content": "7006652"},
                               {"role": "tool", "name": "multiply", "content": "6"}], tool_calls=2)  # fmt: skip


def test_a_turn_without_a_tool_call_ends_the_episode_and_the_last_turn_runs_no_tools(env):
    assert step(env, "The answer is 7006652.") == Observation([], done=True)
    assert step(env, call("multiply", a=1, b=2), turns=3) == Observation([], done=True)


@pytest.mark.parametrize(
    "text, error",
    [
        (call("raises", x=1), "Error: tool raises raised ZeroDivisionError: integer division or modulo by zero"),
        (call("hangs"), "Error: tool hangs did not return within 0.2 s"),
        (call("number"), "Error: tool number returned int, not text (a tool returns a str)"),
        (call("prints"), "Error: tool prints printed to stdout instead of returning its output as text"),
        (call("exits"), "Error: tool exits raised SystemExit: 3"),
        (call("divide", a=1), "Error: there is no tool 'divide'; the tools are echo, exits, hangs, multiply, number"),
        (call("multiply", a=1), "Error: wrong arguments for multiply: missing a required argument: 'b'"),
        ("<tool_call>{not json}</tool_call>", "Error: the tool call is not valid JSON"),
        ('<tool_call>{"name": "multiply"}', "Error: wrong arguments for multiply"),  # unclosed, no arguments
        ('<tool_call>["multiply"]</tool_call>', 'Error: a tool call needs "name" (text) and "arguments"'),
        ("<tool_call>" + "[" * 5000, "Error: the tool call is not valid JSON (nested too deeply)"),  # was a crash
        ('<tool_call>{"name": "multiply", "arguments": "' + "[" * 5000 + '"}', 'Error: a tool call needs "name"'),
        ('<tool_call>{"name": "multiply", "arguments": {"a": ' + "9" * 4301 + ', "b": 2}}</tool_call>',  # was a crash
         "Error: the tool call is not valid JSON (a number too long)"),
        (call("echo", text="a\ud800b"), "a?b"),  # a lone surrogate (JSON allows it): the tokenizer refused it
        (call("n" * 5000), "Error: there is no tool 'nnnn"),  # refusals are cut to max_output_chars too
    ],
)
def test_every_failure_is_an_error_observation_and_the_episode_goes_on(env, text, error, capsys):
    started = time.perf_counter()
    obs = step(env, text)
    assert not obs.done and obs.tool_calls == 1 and obs.tool_failures == (error != "a?b")
    assert len(obs.messages[0]["content"]) <= 2000 and obs.messages[0]["content"].encode("utf-8")
    assert obs.messages[0]["role"] == "tool" and obs.messages[0]["content"].startswith(error)
    assert time.perf_counter() - started < 2.0
    assert capsys.readouterr().out == ""  # what a tool prints does not reach the run's output


def test_a_few_shot_prompt_s_assistant_messages_are_not_the_model_s_turns(env):
    """``max_turns`` counts the model's turns: a prompt holding an earlier exchange used to cost the model a turn per
    assistant message in it, and with ``max_turns`` of them its first call ran no tool."""
    shot = call("multiply", a=2, b=3)
    few_shot = Example([{"role": "user", "content": "2 * 3?"}, {"role": "assistant", "content": shot},
                        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"},
                        {"role": "user", "content": "1234 * 5678?"}], "7006652")  # fmt: skip
    messages = env.start(few_shot) + [{"role": "assistant", "content": call("multiply", a=1234, b=5678)}]
    assert env.step(few_shot, messages).tool_calls == 1
    messages += [{"role": "tool", "content": "7006652"}, {"role": "assistant", "content": call("multiply", a=1, b=1)}]
    messages += [{"role": "tool", "content": "1"}, {"role": "assistant", "content": call("multiply", a=1, b=2)}]
    assert env.step(few_shot, messages) == Observation([], done=True)  # the model's third turn: max_turns 3


def power(base: int, exponent: int) -> str:
    return str(len(str(base**exponent)))  # one C call that holds the interpreter lock for as long as it runs


def test_tool_workers_end_a_call_stuck_in_one_long_c_call_at_the_timeout():
    """A thread's timeout waits for the interpreter lock: this call held it for 65 s against a 0.5 s timeout. In a
    worker process (``tool_workers``) the call is killed at the timeout, the other failures read as in a thread,
    and the next call runs."""
    env = ToolEnvironment([multiply, raises, prints, exits, power], tool_timeout=0.5, tool_workers=1)
    started = time.perf_counter()
    obs = step(env, call("power", base=7, exponent=7**9))
    assert obs.messages[0]["content"] == "Error: tool power did not return within 0.5 s" and obs.tool_failures == 1
    assert time.perf_counter() - started < 5.0
    assert step(env, call("multiply", a=6, b=7)).messages[0]["content"] == "42"
    replies = [step(env, call(name, **args)).messages[0]["content"] for name, args in
               (("raises", {"x": 1}), ("prints", {}), ("exits", {}))]  # fmt: skip
    assert replies == ["Error: tool raises raised ZeroDivisionError: integer division or modulo by zero",
                       "Error: tool prints printed to stdout instead of returning its output as text",
                       "Error: tool exits raised SystemExit: 3"]  # fmt: skip


def test_tool_workers_serve_calls_from_several_threads_at_once():
    """``concurrent_steps`` runs episodes' calls in threads: the shared worker pool was not thread-safe (one thread's
    restart killed another's calls; others raised ``Pool not running`` out of the runner, or hung). They take
    turns now: 8 threads x 25 calls, every one answered right, no restart."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.pool import get_pool

    env = ToolEnvironment([multiply], tool_timeout=5.0, tool_workers=3)
    restarts = get_pool(3).restarts
    calls = [(a, b) for a in range(8) for b in range(25)]
    with ThreadPoolExecutor(8) as threads:
        replies = list(threads.map(lambda ab: step(env, call("multiply", a=ab[0], b=ab[1])).messages[0]["content"],
                                   calls, timeout=60))  # fmt: skip
    assert replies == [str(a * b) for a, b in calls] and get_pool(3).restarts == restarts


def naps(x: int) -> str:
    """Wait 0.2 s (a tool that waits on a server), then answer."""
    time.sleep(0.2)
    return str(2 * x)


def test_tool_workers_run_a_round_s_calls_together_with_the_serial_answers():
    """The episode loop's round of 8 episodes: with ``tool_workers`` and ``concurrent_steps`` each call was a
    ``pool.run`` of its own, the step threads taking turns on the pool (1.6 s for 8 calls of 0.2 s on 4 workers, no
    speed-up). The round's calls go to the pool together now (0.4 s), every episode answered as one by one; a call
    that raises, hangs or cannot run is counted as before, and the others' answers are kept."""
    from types import SimpleNamespace

    from sgrpo.rollout.episodes import _steps

    env = ToolEnvironment([naps, raises, hangs, exits], tool_timeout=0.5, tool_workers=4, concurrent_steps=8)

    def round_(texts: list[str]) -> list:
        return [SimpleNamespace(example=EXAMPLE, messages=[*env.start(EXAMPLE), {"role": "assistant", "content": t}])
                for t in texts]  # fmt: skip

    one_by_one = lambda texts: [env.step(t.example, t.messages) for t in round_(texts)]  # noqa: E731
    naps_round = [call("naps", x=i) for i in range(8)]
    one_by_one(naps_round[:1])  # the pool started
    started = time.perf_counter()
    together = _steps(env, round_(naps_round))
    assert time.perf_counter() - started < 0.6 * 8 * 0.2
    assert together[:2] == one_by_one(naps_round[:2]) and [o.messages[0]["content"] for o in together] == [
        str(2 * i) for i in range(8)]  # fmt: skip
    mixed = [call("naps", x=1) + call("raises", x=1), "no call", call("hangs") + call("naps", x=2),
             call("exits") + call("nope"), call("naps", x=3)]  # fmt: skip
    together = _steps(env, round_(mixed))
    assert together == one_by_one(mixed)
    assert [(o.tool_calls, o.tool_failures, o.done) for o in together] == [(2, 1, False), (0, 0, True), (2, 1, False),
                                                                           (2, 2, False), (1, 0, False)]  # fmt: skip
    assert [m["content"][:32] for m in together[2].messages] == ["Error: tool hangs did not return", "4"]


def test_failures_are_counted_beside_successes(env):
    obs = step(env, call("multiply", a=2, b=2) + call("number") + call("raises", x=0))
    assert (obs.tool_calls, obs.tool_failures) == (3, 2)
    assert [m["content"][:6] for m in obs.messages] == ["4", "Error:", "Error:"]


def test_calls_past_the_limit_per_turn_are_not_run():
    env = ToolEnvironment([multiply], max_calls_per_turn=2)
    obs = step(env, call("multiply", a=1, b=1) * 5)
    assert obs.tool_calls == 2


def test_tools_by_import_path_and_their_schemas():
    env = ToolEnvironment(["tests.test_tools.multiply"])
    assert env.tools == {"multiply": multiply}
    assert tool_schema(multiply) == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"tools\[0\]: cannot import 'tests.test_tools.nothing'"):
        ToolEnvironment(["tests.test_tools.nothing"])
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        ToolEnvironment([multiply, multiply])
    with pytest.raises(ValueError, match="tool_timeout must be > 0"):
        ToolEnvironment([multiply], tool_timeout=0)


def test_the_tools_reach_the_template_that_renders_them_else_a_system_message():
    plain = type("Tok", (), {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})()
    hermes = type("Tok", (), {"chat_template": "{% if tools %}{{ tools | tojson }}{% endif %}..."})()
    env = ToolEnvironment([multiply])
    env.adapt_to_tokenizer(plain)
    opening = env.start(EXAMPLE)
    assert opening[0]["role"] == "system" and '"name": "multiply"' in opening[0]["content"]
    assert "<tool_call>" in opening[0]["content"] and env.template_kwargs(EXAMPLE) == {}
    env.adapt_to_tokenizer(hermes)
    assert env.start(EXAMPLE) == [{"role": "user", "content": EXAMPLE.prompt}]
    assert env.template_kwargs(EXAMPLE) == {"tools": [tool_schema(multiply)]}


def test_parsing_keeps_the_order_and_reads_string_arguments():
    text = call("a", x=1) + ' and <tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    assert parse_tool_calls("no call here") == []


def test_tools_that_print_from_overlapping_calls_leave_stdout_as_it_was(capsys):
    """Calls of several episodes at once (``concurrent_steps``): each print is caught as its call's error, none
    reaches the run's output, and ``sys.stdout`` is the run's own again after the last call."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    env = ToolEnvironment([prints, multiply], concurrent_steps=8)
    before = sys.stdout
    texts = [call("prints"), call("multiply", a=3, b=4)] * 8
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda text: step(env, text).messages[0]["content"], texts))
    assert answers == ["Error: tool prints printed to stdout instead of returning its output as text", "12"] * 8
    assert sys.stdout is before and capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="concurrent_steps must be >= 1"):
        ToolEnvironment([multiply], concurrent_steps=0)


def test_tool_workers_refuse_a_tool_that_cannot_go_to_a_worker_process():
    """A tool defined inside a function does not pickle: under ``tool_workers`` every call to it came back as a
    failure ("Error: ...") that the model was trained on, with nothing said. It is refused where the environment is
    built, naming the tool and the fix; in threads (``tool_workers`` 0) it runs."""

    def local_square(x: int) -> str:
        """Square a number."""
        return str(x * x)

    with pytest.raises(ValueError, match=r"tools: local_square .* cannot go to a worker process .* tool_workers: 0"):
        ToolEnvironment([multiply, local_square], tool_workers=1)
    assert step(ToolEnvironment([local_square]), call("local_square", x=3)).messages[0]["content"] == "9"
