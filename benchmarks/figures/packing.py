"""Render of the packing artefact (``benchmarks/packing.py``): the update's log-probs, padded against packed."""

from __future__ import annotations

from benchmarks.figures._fmt import num, table, words, wrap

#: the speed-up over today's trimmed update that issue 34 asks of the packed update on a length-skewed workload
TARGET = 1.5
#: ratios within this of 1 either way count as no difference (best of a few rounds on a shared machine)
BAND = 0.1
TODAY, UNSHARED, PACKED, SHARED = "padded+shared", "padded", "packed", "packed+shared"


def _name(w: dict) -> str:
    budget = "auto" if w["budget"] == "auto" else num(w["budget"], 0)
    return f"{w['skew']} / {w['prompt']} / G {w['G']} / {budget}"


def _list(names: list[str]) -> str:
    return f"{len(names)} ({words(names)})" if names else "none"


def _versus_today(work: list[dict], mode: str, what: str) -> str:
    """``mode``'s speed-ups over the trimmed update: the largest, where it reaches ``TARGET``, where it loses."""
    speedup = {_name(w): w["modes"][TODAY]["best_s"] / w["modes"][mode]["best_s"] for w in work}
    best = max(speedup, key=speedup.get)
    skewed = [f"{speedup[_name(w)]:.2f}x at `micro_batch_tokens` {w['budget']}" for w in work
              if (w["skew"], w["prompt"], w["G"]) == ("log-uniform", "long", 16)]  # fmt: skip
    reached = [name for name, s in speedup.items() if s >= TARGET]
    slower = [name for name, s in speedup.items() if s < 1 - BAND]
    even = [name for name, s in speedup.items() if 1 - BAND <= s <= 1 + BAND]
    return (
        f"The {what}'s largest speed-up over the trimmed update is {speedup[best]:.2f}x ({best}); "
        + (f"it reaches {TARGET}x in {len(reached)} of {len(work)} workloads ({words(reached)}). "
           if reached else f"it reaches {TARGET}x in none of the {len(work)} workloads. ")
        + f"It does not pay (slower than the trimmed update by more than {BAND:.0%}) in {_list(slower)}; within "
        f"{BAND:.0%} either way in {_list(even)}."
        + (f" On the skewed workload of issue 34 (log-uniform completions, long prompts, G 16) the {what}'s "
           f"speed-up over the trimmed update is {words(skewed)}." if skewed else "")
    )  # fmt: skip


def _pays(work: list[dict], slow: str, fast: str, what: str) -> str:
    """Where ``fast`` (a change of layout) does not pay against ``slow``."""
    ratio = {_name(w): w["modes"][slow]["best_s"] / w["modes"][fast]["best_s"] for w in work}
    loses = [name for name, s in ratio.items() if s < 1 - BAND]
    even = [name for name, s in ratio.items() if 1 - BAND <= s <= 1 + BAND]
    return f" {what} does not pay ({fast} slower than {slow} by more than {BAND:.0%}) in {_list(loses)}; within " \
        f"{BAND:.0%} either way in {_list(even)}."


def packing(stamp: dict) -> str:
    r, machine = stamp["result"], stamp["machine"]
    m, work = r["model"], r["workloads"]
    shown = [k for k in (TODAY, UNSHARED, PACKED, SHARED) if k in work[0]["modes"]]  # SHARED: runs after issue 34.3
    for w in work:  # the speed-ups are the best times' ratios, and every layout ran the same real tokens
        modes = w["modes"]
        for mode in modes.values():
            assert abs(mode["packed_speedup"] - mode["best_s"] / modes[PACKED]["best_s"]) < 1e-9
            assert mode["real"] == modes[PACKED]["real"] and mode["best_s"] == min(mode["times_s"])
    named = {TODAY: "*Padded+shared* is the trimmed update before packing (`packing: false`, `share_prompts: true`)",
             UNSHARED: "*padded* the same without prompt sharing",
             PACKED: "*packed* `packing: true`" + (", `share_prompts: false`" if SHARED in shown else ""),
             SHARED: "*packed+shared* `packing: true`, `share_prompts: true` (each group's prompt once where the cost "
                     "model says it pays)"}  # fmt: skip
    prose = (
        f"`{stamp['command']}` (published {stamp['date']} on {machine['cpus']} CPUs, load average "
        f"{machine['load_average'][0]}; wall time {num(r['wall_s'], 0)} s): CPU seconds of one gradient pass's "
        f"log-probs (forward and backward over the update's own micro-batches), best of {r['repeats']} rounds "
        f"after a warm-up, for a random Llama of hidden size {m['hidden']}, {m['layers']} layers, vocabulary "
        f"{num(m['vocab'], 0)} (fp32, SDPA, {r['threads']} thread), {r['rows']} rows per workload, completions "
        f"capped at {r['cap']} tokens. Workloads are named skew / prompt / G / `micro_batch_tokens`. "
        + ", ".join(named[k] for k in shown)
        + "; padding is 1 - real tokens / tokens the forward computes (below 0 where shared prompts compute fewer "
        "than the real tokens).\n\n"
        + _versus_today(work, PACKED, "packed update")
        + (" " + _versus_today(work, SHARED, "packed, prompt-shared update") if SHARED in shown else "")
        + (_pays(work, UNSHARED, TODAY, "Prompt sharing (padded)") if UNSHARED in shown else "")
        + (_pays(work, PACKED, SHARED, "Prompt sharing (packed)") if SHARED in shown else "")
    )
    head = ["workload", "padding: " + " / ".join(shown), *(f"{k} (s)" for k in shown),
            *(f"{k} speed-up over {TODAY}" for k in shown[1:])]  # fmt: skip
    rows = []
    for w in work:
        modes = w["modes"]
        pads = " / ".join(f"{modes[k]['padding_fraction']:.2f}" for k in shown)
        times = [f"{modes[k]['best_s']:.2f}" for k in shown]
        ratios = [f"{modes[TODAY]['best_s'] / modes[k]['best_s']:.2f}" for k in shown[1:]]
        rows.append([_name(w), pads, *times, *ratios])
    return wrap(prose) + "\n" + table(head, rows) + "\n"
