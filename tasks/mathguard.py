"""Guards that keep adversarial math answers from stalling the grader (used by ``tasks.mathgrade``).

Before sympy sees a box, cheap checks reject what no answer needs and what would make sympy run away: a
box over ``max_answer_chars`` ("too_long"), control characters or undecodable bytes ("junk"), brackets
nested over ``MAX_NESTING`` or exponents over ``MAX_EXPONENT_DEPTH`` ("too_complex"), and, once parsed,
a number over ``MAX_DIGITS`` digits such as ``9^{9^{9}}`` or a polynomial power of over
``MAX_EXPANSION_TERMS`` terms such as ``(1+x)^{1000}`` ("too_complex", via ``_log10_bound``). What still
runs away is cut by ``_deadline`` on the whole grading, in CPU time. math-verify's own timeouts (``signal.alarm``,
wall time, whole seconds, per call) are replaced by that deadline (``signal.setitimer(ITIMER_PROF)``, main thread
only).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Iterator

from sympy import Basic, binomial, exp, factorial, factorial2, gamma

_JUNK = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")  # control characters, undecodable bytes

#: cheap limits on a box before sympy sees it (``reject_box``) and on what it parses to (``_log10_bound``)
MAX_ANSWER_CHARS = 1000
MAX_NESTING = 12  # braces, parentheses and brackets: each level of parentheses costs math-verify ~40 ms
MAX_EXPONENT_DEPTH = 3  # 2^{2^{2^{2}}} (3 nested exponents) passes, x^{x^{x^{x^{x}}}} does not
MAX_DIGITS = 100_000  # 2^{300000} passes; 9^{9^{9}} (370 million digits) does not
MAX_EXPANSION_TERMS = 200  # (1+x)^{199} passes; (1+x)^{1000} and (x+y+z)^{30} do not


def reject_box(box: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The label of a box no answer needs and sympy may choke on ("too_long", "junk", "too_complex"), else None.

    Pure string checks, linear in the box's length: length, control characters or U+FFFD (bytes that did
    not decode), ``{ ( [`` nested over ``MAX_NESTING``, exponents nested over ``MAX_EXPONENT_DEPTH``.
    """
    if len(box) > max_chars:
        return "too_long"
    if _JUNK.search(box):
        return "junk"
    groups: list[bool] = []  # open groups: True for an exponent ``^{``
    exponents = 0  # exponent groups open
    previous = ""
    for char in box:
        if char in "{([":
            groups.append(char == "{" and previous == "^")
            exponents += groups[-1]
            if len(groups) > MAX_NESTING:
                return "too_complex"
        elif char in "})]" and groups:  # any closer closes the innermost group: intervals like [0, 1)
            exponents -= groups.pop()
        elif char == "^" and exponents >= MAX_EXPONENT_DEPTH:
            return "too_complex"
        if not char.isspace():
            previous = char
    return None


_LOG10_2 = math.log10(2)


def _log10_bound(expr: Basic) -> float:
    """A cheap upper bound of the number of digits of ``expr`` (symbols count as 1), without evaluating it.

    ``inf`` for powers that expand a sum of symbols into over ``MAX_EXPANSION_TERMS`` terms.
    """
    if expr.is_Rational:
        return math.log10(max(abs(expr.p), abs(expr.q), 1))  # exact for Python ints of any size
    if expr.is_Float:
        _, mantissa, exponent, bits = expr._mpf_
        return abs(exponent + bits) * _LOG10_2 if mantissa else 0.0
    if expr.is_Pow:
        base, exponent = expr.args
        if base.free_symbols and base.is_Add and exponent.is_Integer and abs(exponent) > 1:
            terms = math.comb(abs(int(exponent)) + len(base.args) - 1, len(base.args) - 1)
            if terms > MAX_EXPANSION_TERMS:
                return math.inf
        return max(_log10_bound(base), _LOG10_2) * _magnitude(exponent)
    if isinstance(expr, exp):
        return _magnitude(expr.args[0]) * math.log10(math.e)
    if isinstance(expr, (factorial, factorial2, gamma, binomial)):  # n! <= n^n, C(n, k) <= n^k
        n = _magnitude(expr.args[0])
        k = _magnitude(expr.args[1]) if isinstance(expr, binomial) else n
        return min(n, k) * math.log10(max(n, 2.0))
    parts = [_log10_bound(arg) for arg in expr.args if isinstance(arg, Basic)]
    if not parts:
        return 0.0
    if expr.is_Mul:
        return sum(parts)
    return max(parts) + math.log10(len(parts))  # sums, functions, containers: about the largest part


def _magnitude(expr: Basic) -> float:
    """An upper bound of ``|expr|`` (``inf`` past 1e15)."""
    digits = _log10_bound(expr)
    return 10.0**digits if digits < 15 else math.inf


class _Deadline(BaseException):
    """Raised by SIGPROF inside math-verify or sympy when the grading's CPU time is up (caught by grade_math)."""


@contextlib.contextmanager
def _deadline(seconds: float | None, repeat: float = 0.05) -> Iterator[None]:
    """Raise ``_Deadline`` in this block after ``seconds`` of CPU time (main thread only; elsewhere no limit).

    CPU time, not wall time: the process's user + system time (``ITIMER_PROF``, signal ``SIGPROF``). What the
    deadline guards against is an answer that makes sympy compute for long, which costs CPU; wall time also
    counts the time the process waits for a core, so on a loaded machine (a training node's data workers, a
    2-core CI box at load 4) a wall-time deadline cut correct answers (0.1 s of CPU, over 1.5 s of wall time
    when starved) and scored them 0 at random. A hang that spends no CPU is not cut here: in a reward worker
    the pool's wall-clock limit (``tasks.pool``) ends it. The timer counts every thread of the process, so a
    process whose other threads are busy reaches the deadline sooner (never later).

    The signal keeps firing every ``repeat`` seconds of CPU time until the block exits: Python drops an exception
    raised while it runs a finaliser or a weakref callback ("Exception ignored in ..."), so a one-shot signal
    that lands there would be lost and the grading would run unbounded. A profiling timer already running
    (``ITIMER_PROF``) is re-armed on exit with the CPU time it had left; a wall-clock alarm (``ITIMER_REAL``,
    ``SIGALRM``) is not touched.
    """
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.getsignal(signal.SIGPROF)
    if previous is None:  # a handler installed outside Python: restore the default
        previous = signal.SIG_DFL
    active = [True]

    def expire(signum, frame):
        if active[0]:
            raise _Deadline

    signal.signal(signal.SIGPROF, expire)
    outer, outer_repeat = signal.setitimer(signal.ITIMER_PROF, seconds, repeat)
    start = time.process_time()  # the same clock: user + system time of the process
    try:
        yield
    finally:
        while active[0]:  # once this holds False the handler is inert; a signal before that is retried
            try:
                active[0] = False
            except _Deadline:
                continue
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        if outer:  # someone else's profiling timer was running: re-arm what is left of it
            signal.setitimer(signal.ITIMER_PROF, max(outer - (time.process_time() - start), 1e-3), outer_repeat)


class _DropTimeoutDisabled(logging.Filter):
    """math-verify warns that its timeouts are off; ``grade_math`` sets its own deadline instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabled())
