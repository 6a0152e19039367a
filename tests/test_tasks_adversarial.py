"""1,000 adversarial completions through the real DeepMath reward: no exception, {0, 1}, within budget.

The completions are generated deterministically (seeded): 10,000-character LaTeX soup, unbalanced
braces, 200 nested boxes, no box, random bytes, NUL characters, 5,000-digit numbers, exponent towers,
long square-root chains, sympy bombs (``10^{10^{10^{10}}}``, ``(1+x)^{100000}``, ...), a few answers that
slip past the grader's cheap checks and only stop at its deadline, and some correct answers.
"""

import _thread
import contextlib
import logging
import math
import random
import resource
import signal
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from tasks import DeepMath, MathVerifyReward, grade_math
from tasks.mathguard import MAX_ANSWER_CHARS, _Deadline, _deadline, _log10_bound, reject_box
from tasks.pool import get_pool

JSONL = "tests/fixtures/deepmath.jsonl"
N = 1000
WORKERS = 2
TIMEOUT = 3.0  # wall seconds per answer: the pool's outer limit; math-verify's deadline is a quarter (0.75 s of CPU)
#: CPU-time budget of the 1,000 in the workers (not wall time, which on a loaded machine measures the load: 40.8 s
#: at load average 11 on 2 cores, where the wall-time budget was 60 s): 6 answers that only stop at the deadline,
#: ~15 ms per other answer; measured 8.5 s. Every answer run on to the deadline would cost up to N * TIMEOUT / 4
BUDGET_CPU_S = 60.0

#: spellings of each fixture gold answer that math-verify accepts
CORRECT = {
    "-\\dfrac{9}{2}": ["-4.5", "-\\frac{9}{2}", "-\\dfrac{9}{2}", "\\frac{-9}{2}"],
    "504": ["504", "504.0", "\\text{504}"],
    "\\dfrac{\\pi^2}{6}": ["\\pi^2/6", "\\frac{\\pi^{2}}{6}", "\\dfrac{\\pi^2}{6}"],
    "481": ["481", "481."],
    "Yes": ["Yes", "yes", "\\text{Yes}"],
}
#: parse quickly, then make sympy run for over 20 s (measured): only the deadline stops them
SLOW = [r"\sum_{k=1}^{10^{6}} \frac{1}{k^{2}}", r"\int_0^1 x^{150}(1-x)^{150} dx"]
BOMBS = [
    r"10^{10^{10^{10}}}",
    r"(1+x)^{100000}",
    r"9^{9^{9}}",
    r"2^{2^{2^{2^{2^{2}}}}}",
    r"(10^{10})!",
    r"\binom{10^{9}}{10^{5}}",
    r"\sin(10^{10^{10}})",
    r"e^{e^{e^{e^{10}}}}",
    r"(x+y+z)^{30}",
    r"\int_0^1 x^{1000}(1-x)^{1000} dx",
    r"10^{-10^{7}}",
    r"1.5^{10^{9}}",
]
TOKENS = [
    r"\frac{", "}", "{", r"\sqrt{", "x^{", "^", "_", r"\int_0^1", r"\sum_{k=1}^{n}", "+", "-", r"\cdot", "(", ")",
    r"\left(", r"\right)", "2", "17", r"\pi", r"\alpha", " ", r"\\", "$", r"\boxed{", "=", r"\begin{matrix}",
    r"\end{matrix}", "&", r"\text{so}", r"\infty", "\n",
]  # fmt: skip


def _soup(rng: random.Random, chars: int) -> str:
    parts, size = [], 0
    while size < chars:
        parts.append(rng.choice(TOKENS))
        size += len(parts[-1])
    return "".join(parts)[:chars]


def _junk(rng: random.Random, size: int) -> str:
    return bytes(rng.getrandbits(8) for _ in range(size)).decode("utf-8", errors="replace")


def _make(kind: str, gold: str, rng: random.Random) -> str:
    """One completion of ``kind`` for an example whose answer is ``gold``."""
    if kind == "correct":
        filler = _soup(rng, rng.choice([50, 2000, 9000]))  # junk inside the think block does not matter
        return f"<think>\n{filler}\n</think>\nSo the answer is \\boxed{{{rng.choice(CORRECT[gold])}}}."
    if kind == "slow":
        return f"The answer is \\boxed{{{rng.choice(SLOW)}}}."
    if kind == "soup":
        return _soup(rng, 10_000)
    if kind == "soup_boxed":  # soup, then a box of soup (unbalanced braces cut it short, or not)
        return _soup(rng, 10_000 - 1000) + "\\boxed{" + _soup(rng, rng.choice([100, 500, 990])) + "}"
    if kind == "unbalanced":
        return rng.choice(
            [r"\boxed{\frac{1}{2", r"\boxed{504", r"\boxed{{{{{", r"}}}}\boxed{1}}}}", r"\boxed{\sqrt{\frac{\pi}{"]
        ) + _soup(rng, rng.randrange(0, 200))
    if kind == "nested_boxes":
        depth = rng.choice([50, 200, 200])
        return "\\boxed{" * depth + rng.choice(["7", r"\frac{1}{3}", ""]) + "}" * rng.choice([depth, depth - 1])
    if kind == "no_box":
        return "Let me think. " * rng.randrange(1, 700) + rng.choice(["The answer is 504.", "$x = 1$", ""])
    if kind == "binary_junk":
        junk = _junk(rng, rng.randrange(10, 10_000))
        return junk if rng.random() < 0.5 else f"\\boxed{{{junk[:900]}}}"
    if kind == "nul":
        inside = rng.choice(["504\x00", "\x00" * 50, "4\x0081", "-\\frac{9}{2}\x00\x00"])
        return "\x00" * rng.randrange(0, 5000) + f"\\boxed{{{inside}}}" + "\x00" * rng.randrange(0, 10)
    if kind == "huge_number":
        digits = "9" * 5000 if rng.random() < 0.7 else "1" + "0" * rng.randrange(300, 999)
        return f"\\boxed{{{digits}}}"
    if kind == "tower":
        depth = rng.randrange(4, 200)
        return "\\boxed{" + "x^{" * depth + "x" + "}" * depth + "}"
    if kind == "sqrt_chain":
        depth = rng.randrange(13, 400)
        inner = rng.choice([r"\sqrt{", r"\sqrt{2+"])
        return "\\boxed{" + inner * depth + "2" + "}" * depth + "}"
    if kind == "sqrt_flat":  # long but shallow: a product of square roots
        roots = (rng.choice([r"\sqrt{2}", r"\sqrt{3}", r"\sqrt{5}"]) for _ in range(rng.randrange(20, 140)))
        return "\\boxed{" + "".join(roots) + "}"
    if kind == "bomb":
        return f"\\boxed{{{rng.choice(BOMBS)}}}"
    if kind == "wrong":
        return f"<think>\n{_soup(rng, 1500)}\n</think>\nThe answer is \\boxed{{{rng.randrange(1, 400)}}}."
    raise ValueError(kind)


KINDS = [
    "soup", "soup_boxed", "unbalanced", "nested_boxes", "no_box", "binary_junk", "nul", "huge_number", "tower",
    "sqrt_chain", "sqrt_flat", "bomb", "wrong",
]  # fmt: skip
COUNTS = {"correct": 40, "slow": 8}  # slow answers to "Yes" never reach sympy (a string check)


def adversarial_batch(n: int = N, seed: int = 0) -> tuple[list, list[str], list[str]]:
    """``n`` (example, completion, kind) triples over the 5 fixture rows, deterministic in ``seed``."""
    rng = random.Random(seed)
    rest = n - sum(COUNTS.values())
    kinds = [k for k, c in COUNTS.items() for _ in range(c)] + [KINDS[i % len(KINDS)] for i in range(rest)]
    rng.shuffle(kinds)
    examples = DeepMath(path=JSONL, validation_size=0).examples("train")
    batch = [examples[i % len(examples)] for i in range(n)]
    return batch, [_make(kind, ex.answer, rng) for ex, kind in zip(batch, kinds, strict=True)], kinds


def test_the_batch_is_as_adversarial_as_advertised():
    examples, completions, kinds = adversarial_batch()
    assert len(completions) == N and adversarial_batch()[1] == completions  # deterministic
    by_kind = {k: [c for c, kk in zip(completions, kinds, strict=True) if kk == k] for k in set(kinds)}
    assert all(len(c) == 10_000 for c in by_kind["soup"])
    assert any("\x00" in c for c in by_kind["nul"]) and any("\ufffd" in c for c in by_kind["binary_junk"])
    assert any(c.count("\\boxed{") == 200 for c in by_kind["nested_boxes"])
    assert any("9" * 5000 in c for c in by_kind["huge_number"])
    assert {r"\boxed{10^{10^{10^{10}}}}", r"\boxed{(1+x)^{100000}}"} <= set(by_kind["bomb"])


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have ended and been reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_seconds(fn, *args) -> float:
    """The CPU seconds of ``fn(*args)`` in this process (a reward worker), a ``TimeoutError`` included."""
    start = time.process_time()
    with contextlib.suppress(TimeoutError):
        fn(*args)
    return time.process_time() - start


@pytest.mark.slow
def test_a_thousand_adversarial_completions_score_safely_within_budget(caplog):
    examples, completions, kinds = adversarial_batch()
    reward = MathVerifyReward(workers=WORKERS, timeout=TIMEOUT)
    pool = get_pool(WORKERS)
    pool.close()  # fresh workers: their CPU time is counted once they end (RUSAGE_CHILDREN)
    warm = [f"\\boxed{{{CORRECT[e.answer][-1]}}}" for e in examples[:10]]
    grade_math(examples[0].answer, warm[0])  # sympy's first call is slow: warm this process (workers fork from it)
    cpu_before = children_cpu_s()
    reward.score(examples[:10], warm)  # and start the workers (counted: ~0.1 s)
    restarts = pool.restarts
    caplog.set_level(logging.WARNING, logger="tasks.pool")
    start = time.perf_counter()
    result = reward.score(examples, completions)
    wall = time.perf_counter() - start
    pool.close()  # ends (and reaps) the workers
    cpu = children_cpu_s() - cpu_before
    print(
        f"\n{N} adversarial completions: {cpu:.1f} s of CPU in {WORKERS} workers (budget {BUDGET_CPU_S:g} s), "
        f"{wall:.1f} s wall, {pool.restarts - restarts} restarts; {result.counts}"
    )

    values = result.total
    assert values.shape == (N,) and values.dtype == torch.float32
    assert set(values.tolist()) <= {0.0, 1.0}
    correct = torch.tensor([k == "correct" for k in kinds])
    missed = [c[-60:] for c, k, v in zip(completions, kinds, values.tolist(), strict=True) if k == "correct" and v != 1]
    assert not missed
    assert values[~correct].eq(0.0).all()  # no adversarial completion scores
    assert cpu < BUDGET_CPU_S

    counts = Counter(result.counts)
    assert sum(counts.values()) == N  # one label per completion
    assert counts["correct"] == COUNTS["correct"] and counts["error"] == 0  # nothing raised in the grader
    slow = sum(k == "slow" and e.answer != "Yes" for e, k in zip(examples, kinds, strict=True))
    assert counts["timeout"] >= slow > 0  # the deadline cut the slow ones ...
    assert result.failures == counts["timeout"] + counts["error"]  # ... and they are counted as failures
    for label in ("no_box", "too_long", "junk", "too_complex"):
        assert counts[label] > 0, label
    # The per-answer deadline (0.75 s of CPU time) cuts the slow answers, and load does not cut a correct one (a
    # wall-time deadline of 1.5 s cut a correct answer at load average 4-5 on 2 cores: 0.1 s of CPU, starved);
    # the pool's outer limit (3 s of wall time) replaces a worker whose answer ran past it, and the answer still
    # scores 0 and is counted above. How often depends on the load (a worker that gets under a quarter of a core,
    # or a C call that delays the signal), so the restarts are
    # checked for what they are: each one the outer limit (not a worker that died), on an answer that the
    # deadline ends within TIMEOUT seconds of CPU (re-graded in a worker, under a 30 s outer limit: with a
    # deadline that failed, or a bomb past the cheap checks, it runs for minutes of CPU).
    cut = [record.args for record in caplog.records if record.getMessage().endswith("restarting the worker pool")]
    assert len(cut) == pool.restarts - restarts
    assert all(error.startswith("timeout after") for _, error in cut), cut
    again = pool.run(cpu_seconds, [(reward.score_one, examples[i], completions[i]) for i, _ in cut], 10 * TIMEOUT)
    pool.close()
    for (i, _), outcome in zip(cut, again, strict=True):
        assert outcome.ok and outcome.value < TIMEOUT, (kinds[i], completions[i][-80:], outcome)


@pytest.mark.parametrize(
    ("box", "label"),
    [
        ("9" * 5000, "too_long"),
        ("\\frac{1}{2}\x00", "junk"),
        ("1\ufffd", "junk"),
        ("x^{" * 4 + "x" + "}" * 4, "too_complex"),
        ("\\sqrt{" * 13 + "2" + "}" * 13, "too_complex"),
        ("(" * 13 + "1" + ")" * 13, "too_complex"),
        ("\\left(" * 7 + "\\frac{1}{" * 6 + "2" + "}" * 6 + "\\right)" * 7, "too_complex"),
        ("x^{x^{x}}", None),
        ("2^{2^{2^{2}}}", None),
        ("\\sqrt{" * 12 + "2" + "}" * 12, None),
        ("\\dfrac{\\pi^2}{6}", None),
        ("(-\\infty, 0] \\cup [1, 2)", None),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", None),
    ],
)
def test_reject_box(box, label):
    assert reject_box(box) == label
    assert len("9" * 5000) > MAX_ANSWER_CHARS


@pytest.mark.parametrize(
    ("gold", "box", "label"),
    [
        ("504", "9^{9^{9}}", "too_complex"),  # 370 million digits
        ("504", "(1+x)^{1000}", "too_complex"),  # 1,001 terms once expanded
        ("504", "(10^{10})!", "too_complex"),
        ("504", "\\Gamma(10^{10})", "too_complex"),
        ("504", "2^{2024}", "wrong"),  # 610 digits: graded
        ("(1+x)^{3}", "x^3+3x^2+3x+1", "correct"),
        ("2^{2024}", "4^{1012}", "correct"),
        ("\\dfrac{\\pi^2}{6}", "\\frac{\\pi^{2}}{6}", "correct"),
        ("504", "\\sum_{k=1}^{10^{6}} \\frac{1}{k^{2}}", "timeout"),
    ],
)
def test_grade_math_on_costly_answers(gold, box, label):
    if label == "timeout":
        start = time.process_time()  # CPU time: the wall time on a loaded machine is the load's (6.3 s at load 8)
        with pytest.raises(TimeoutError, match="took over 0.5 s"):
            grade_math(gold, f"\\boxed{{{box}}}", timeout=0.5)
        assert time.process_time() - start < 5.0  # sympy alone runs for over 20 s of CPU (the alarm waits for C calls)
    else:
        assert grade_math(gold, f"\\boxed{{{box}}}", timeout=10)[1] == label


def test_size_bound_is_an_upper_bound_without_evaluating():
    from sympy import Integer, Pow, Rational, Symbol, sqrt

    x = Symbol("x")
    assert _log10_bound(Integer(10) ** 100) == pytest.approx(100)
    assert _log10_bound(Rational(1, 10**50)) == pytest.approx(50)
    assert _log10_bound(Pow(9, Pow(9, 9, evaluate=False), evaluate=False)) > 1e8
    assert _log10_bound(Pow(x + 1, 1000, evaluate=False)) == math.inf
    assert _log10_bound(Pow(x + 1, 3, evaluate=False)) < 5 and _log10_bound(sqrt(2) / 2) < 1


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_deadline_counts_cpu_time_not_the_wall_time_of_a_starved_process():
    """A grading that waits (a process descheduled on a loaded machine, simulated by a sleep) is not cut; a grading
    that computes is. On the old wall-time deadline the sleeper was cut after 0.5 s."""
    start = time.monotonic()
    with _deadline(0.5):
        time.sleep(1.5)  # 1.5 s of wall time, ~0 of CPU
    assert time.monotonic() - start >= 1.5
    start = time.process_time()
    with pytest.raises(_Deadline), _deadline(0.3):
        _burn(10.0)
    # the kernel counts CPU time in ticks, the timer and process_time() apart: about 0.3 s (0.248 on a loaded machine)
    assert 0.15 <= time.process_time() - start < 2.0
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


def test_a_correct_answer_graded_by_a_starved_worker_scores(monkeypatch):
    """``grade_math`` with a deadline of 0.5 s: a grading that takes 2 s of wall time but little CPU (starved of
    CPU) still scores 1, while one that burns CPU is cut with a ``TimeoutError``."""
    import tasks.mathgrade

    def starved(gold, target):
        time.sleep(2.0)
        return 1.0, "correct"

    monkeypatch.setattr(tasks.mathgrade, "_verify", starved)
    assert grade_math("504", "\\boxed{\\frac{1008}{2}}", timeout=0.5) == (1.0, "correct")

    def costly(gold, target):
        _burn(10.0)
        return 1.0, "correct"

    monkeypatch.setattr(tasks.mathgrade, "_verify", costly)
    with pytest.raises(TimeoutError, match="took over 0.5 s of CPU time"):
        grade_math("504", "\\boxed{\\frac{1008}{2}}", timeout=0.5)


def test_deadline_restores_the_callers_timers():
    """A caller's profiling timer is re-armed with the CPU time it had left; a caller's wall-clock alarm is not
    touched (it fires into the caller's handler, also during the block)."""
    profiled, alarmed = [], []
    previous_prof = signal.signal(signal.SIGPROF, lambda *_: profiled.append(1))
    previous_alrm = signal.signal(signal.SIGALRM, lambda *_: alarmed.append(1))
    try:
        signal.setitimer(signal.ITIMER_PROF, 0.5)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Deadline), _deadline(0.05):
            time.sleep(0.4)  # the caller's alarm fires here, into its own handler
            _burn(10.0)
        assert alarmed == [1] and not profiled
        assert 0.3 < signal.getitimer(signal.ITIMER_PROF)[0] <= 0.5
        _burn(0.6)  # the caller's own profiling timer was re-armed and fires into the caller's handler
        assert profiled == [1]
        with _deadline(0.5):
            pass
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGPROF, previous_prof)
        signal.signal(signal.SIGALRM, previous_alrm)


def test_deadline_survives_an_alarm_dropped_in_a_finaliser(monkeypatch):
    """Python drops an exception raised in ``__del__``; the deadline's alarm repeats, so the block still ends."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_type))

    class SlowFinaliser:
        def __del__(self):
            end = time.process_time() + 0.3
            while time.process_time() < end:  # the first signal (at 0.1 s of CPU) lands here and is dropped
                pass

    watchdog = threading.Timer(10.0, _thread.interrupt_main)  # a one-shot alarm would spin forever: fail instead
    watchdog.start()
    start = time.monotonic()
    try:
        with pytest.raises(_Deadline), _deadline(0.1):
            SlowFinaliser()  # collected at once
            while True:  # only a later alarm can stop this
                pass
    finally:
        watchdog.cancel()
    assert dropped == [_Deadline]
    assert 0.1 <= time.monotonic() - start < 10.0  # CPU time: on a loaded machine the wall time is longer
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
