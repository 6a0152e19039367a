"""Reward throughput: DeepMath's math-verify reward and the text-similarity rewards, completions per second.

Run with ``.venv/bin/python benchmarks/rewards.py [--n 512] [--repeats 3] [--workers 2]``. It prints
(never asserts) a markdown table of the median wall time of one ``reward.score`` call on a batch of
``--n`` completions (a training step's rollouts) after a warm-up, and the completions per second:

1. ``MathVerifyReward`` in this process (``workers=0``) and in its pool of ``--workers`` processes, on
   DeepMath-style responses (a 1-3K-character think block of LaTeX reasoning, then one sentence with
   the ``\\boxed{}`` answer), half right (often spelt differently from the gold answer, so sympy decides)
   and half wrong, against the fixture's gold answers and other typical ones (fractions, roots, intervals);
2. a training step's grading of those responses by the ``DeepMath`` task (its default reward in a pool of
   ``--workers``): reward and success test apart (two gradings, as the policy did before ``Task.score``),
   and ``Task.score`` (one grading gives both);
3. each similarity reward (chrF, chrF++, BLEU, ROUGE-L, Levenshtein and Indel edit similarity, exact
   match) in this process, on 60-word poems scored against 60-word references (copies with words
   swapped or dropped, and unrelated poems).

The header prints the load average: on a shared machine other processes slow every row. What it prints is
published to ``benchmarks/reports/rewards/`` (``benchmarks/artefact.py``; ``--no-publish`` skips it), each
row's seconds per batch and completions per second as its ``result``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path: import the packages from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
from benchmarks import artefact  # noqa: E402
from sgrpo.types import Example  # noqa: E402
from tasks import (  # noqa: E402
    Bleu,
    ChrF,
    DeepMath,
    EditSimilarity,
    ExactMatch,
    MathVerifyReward,
    Reward,
    RougeL,
    grade_math,
)
from tasks.pool import close_pools  # noqa: E402

#: gold answer -> (right spellings, wrong answers); the first five are the fixture's (tests/fixtures/deepmath.jsonl)
GOLDS = {
    "-\\dfrac{9}{2}": (["-\\dfrac{9}{2}", "-4.5", "-\\frac{9}{2}"], ["-\\frac{9}{4}", "4.5", "-\\frac{2}{9}"]),
    "504": (["504", "504"], ["505", "252", "720"]),
    "\\dfrac{\\pi^2}{6}": (["\\frac{\\pi^2}{6}", "\\pi^2/6", "\\frac{\\pi^{2}}{6}"], ["\\frac{\\pi^2}{12}", "\\pi/6"]),
    "481": (["481"], ["401", "841"]),
    "Yes": (["Yes", "\\text{Yes}"], ["No"]),
    "\\sqrt{3}": (["\\sqrt{3}", "3^{1/2}"], ["\\frac{\\sqrt{3}}{2}", "3"]),
    "(-\\infty, 0)": (["(-\\infty,0)", "(-\\infty, 0)"], ["(-\\infty, 0]", "(0, \\infty)"]),
    "e^{2}": (["e^2", "e^{2}"], ["2e", "e"]),
    "\\dfrac{1}{4}": (["0.25", "\\frac{1}{4}"], ["\\frac{1}{2}", "4"]),
    "2\\sqrt{2}": (["\\sqrt{8}", "2\\sqrt{2}"], ["\\sqrt{2}", "4"]),
}  # fmt: skip
STEPS = [
    "Let $f(x) = {a}x^{{2}} + {b}x + {c}$. Then $f'(x) = {d}x + {b}$, which vanishes at $x = -\\frac{{{b}}}{{{d}}}$.",
    "By the binomial theorem, $\\binom{{{a}}}{{{b}}} = \\frac{{{a}!}}{{{b}!\\,({a}-{b})!}}$.",
    "Substituting $u = {a}t$ gives $\\int_0^{{{b}}} e^{{-u}}\\,du = 1 - e^{{-{b}}}$.",
    "Wait, let me double-check the arithmetic: ${a} \\cdot {b} = {p}$ and ${p} + {c} = {q}$.",
    "Modulo ${b}$, we have ${a} \\equiv {r} \\pmod{{{b}}}$, so the residues repeat with period ${b}$.",
    "\\[ \\sum_{{k=1}}^{{{a}}} k = \\frac{{{a}({a}+1)}}{{2}} = {t}. \\]",
    "Hmm, that does not match the earlier estimate, so let me reconsider the case $n = {c}$.",
    "Using $\\sin^2\\theta + \\cos^2\\theta = 1$ with $\\theta = \\frac{{\\pi}}{{{b}}}$ simplifies the expression.",
]
WORDS = str.split(
    "the a of and in to my your light night sea wind rose heart stone river morning silver green old sleeping "
    "hand winter summer bird song shadow moon sun gold fire rain leaf field road dream grey bright still slow "
    "falls rises sings keeps holds burns fades turns waits under over beyond beside through across"
)


def deepmath_batch(n: int, seed: int = 0) -> tuple[list[Example], list[str], int]:
    """``n`` (example, response) pairs, half right; and how many are right."""
    rng = random.Random(seed)
    examples, responses, right = [], [], 0
    golds = list(GOLDS)
    for i in range(n):
        gold = golds[i % len(golds)]
        steps, size = [], rng.randrange(1000, 3000)
        while sum(map(len, steps)) < size:
            a, b, c = rng.randrange(2, 50), rng.randrange(2, 20), rng.randrange(1, 9)
            p, r = a * b, a % b
            fields = dict(a=a, b=b, c=c, d=2 * a, p=p, q=p + c, r=r, t=a * (a + 1) // 2)
            steps.append(rng.choice(STEPS).format(**fields))
        correct = i % 2 == 0
        answer = rng.choice(GOLDS[gold][0 if correct else 1])
        right += correct
        body = "\n".join(steps)
        examples.append(Example("question", gold))
        responses.append(f"<think>\n{body}\n</think>\nTherefore the final answer is $\\boxed{{{answer}}}$.")
    return examples, responses, right


def poem(rng: random.Random, words: int = 60) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(words // 10)]
    return ",\n".join(lines) + "."


def similarity_batch(n: int, seed: int = 0) -> tuple[list[Example], list[str]]:
    """``n`` 60-word (reference, hypothesis) pairs: references with some words changed, or unrelated poems."""
    rng = random.Random(seed)
    examples, hypotheses = [], []
    for i in range(n):
        reference = poem(rng)
        if i % 3 == 2:
            hypothesis = poem(rng)
        else:
            words = reference.split(" ")
            for _ in range(rng.randrange(1, 20)):
                words[rng.randrange(len(words))] = rng.choice(WORDS)
            hypothesis = " ".join(w for w in words if rng.random() > 0.1)
        examples.append(Example("Write the poem.", reference))
        hypotheses.append(hypothesis)
    return examples, hypotheses


def timed(score, examples: list[Example], completions: list[str], repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``score(examples, completions)`` over ``repeats`` runs after one warm-up, and the
    last result. ``score``: a ``Reward`` (its ``score``) or any such function."""
    score = score.score if isinstance(score, Reward) else score
    result = score(examples, completions)  # warm-up: imports, worker start, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = score(examples, completions)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def step_gradings(examples: list[Example], completions: list[str], workers: int, repeats: int) -> list[tuple]:
    """Rows: a DeepMath step graded as reward and success apart, and by ``Task.score`` (one grading)."""
    task = DeepMath(path=str(_HERE.parent / "tests" / "fixtures" / "deepmath.jsonl"))
    task.reward.workers = workers

    def apart(examples, completions):
        return task.reward.score(examples, completions), task.successes(examples, completions)

    rows = []
    for label, score in (("reward.score + successes (two gradings)", apart), ("Task.score (one grading)", task.score)):
        seconds, _ = timed(score, examples, completions, repeats)
        rows.append((f"DeepMath step: {label}", f"pool of {workers}, reward and success", seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="completions per batch (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per reward, after a warm-up (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="math-verify pool processes (default 2)")
    args = artefact.publish_option(parser).parse_args()
    with artefact.recording() as printed:
        rows, chars = measure(args)
    result = {name: {"seconds": seconds, "per_s": args.n / seconds} for name, _, seconds in rows}
    result["deepmath_response_chars"] = round(chars)  # the mean length of the graded responses, as printed
    artefact.publish_run(args, "rewards", result, printed.getvalue(), __file__)


def measure(args: argparse.Namespace) -> tuple[list[tuple[str, str, float]], float]:
    """Print the header and the table; return its rows (name, batch, seconds per batch) and the mean length in
    characters of the DeepMath responses graded."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    libs = ", ".join(f"{p} {version(p)}" for p in ("math-verify", "sympy", "sacrebleu", "rouge-score", "rapidfuzz"))
    print(f"# Reward throughput: batches of {args.n}, median of {args.repeats} runs")
    print(f"{os.cpu_count()} CPUs, load average {load}; {libs}\n")

    math_examples, responses, right = deepmath_batch(args.n)
    chars = statistics.mean(map(len, responses))
    grade_math(math_examples[0].answer, responses[0])  # sympy's first call is slow; the pool's workers fork warm
    rows = []
    for workers in (0, args.workers):
        reward = MathVerifyReward(workers=workers, timeout=10.0)
        seconds, result = timed(reward, math_examples, responses, args.repeats)
        ok = int(result.total.sum())
        where = "in-process" if workers == 0 else f"pool of {workers}"
        detail = f"{right}/{args.n} right, {chars:.0f} chars; scored {ok} right, {result.failures} failures"
        rows.append((f"MathVerifyReward ({where})", detail, seconds))
    rows += step_gradings(math_examples, responses, args.workers, args.repeats)
    close_pools()

    text_examples, hypotheses = similarity_batch(args.n)
    metrics = [ChrF(), ChrF(word_order=2, name="chrF++"), Bleu(), RougeL(), EditSimilarity()]
    metrics += [EditSimilarity("indel", name="edit (indel)"), ExactMatch()]
    for reward in metrics:
        seconds, result = timed(reward, text_examples, hypotheses, args.repeats)
        detail = f"60-word poems, in-process; mean {result.total.mean().item():.3f}"
        rows.append((f"{type(reward).__name__} `{reward.name}`", detail, seconds))

    print("| reward | batch | s per batch | completions/s | ms per completion |")
    print("|---|---|---:|---:|---:|")
    for name, detail, seconds in rows:
        print(f"| {name} | {detail} | {seconds:.3f} | {args.n / seconds:,.0f} | {1000 * seconds / args.n:.3f} |")
    return rows, chars


if __name__ == "__main__":
    main()
