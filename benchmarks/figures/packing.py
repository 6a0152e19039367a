"""Render of the packing artefact (``benchmarks/packing.py``): the update's log-probs, padded against packed."""

from __future__ import annotations

from benchmarks.figures._fmt import num, table, words, wrap

#: the speed-up over today's trimmed update that issue 34 asks of the packed update on a length-skewed workload
TARGET = 1.5
#: ratios within this of 1 either way count as no difference (best of a few rounds on a shared machine)
BAND = 0.1
TODAY, UNSHARED, PACKED = "padded+shared", "padded", "packed"


def _name(w: dict) -> str:
    budget = "auto" if w["budget"] == "auto" else num(w["budget"], 0)
    return f"{w['skew']} / {w['prompt']} / G {w['G']} / {budget}"


def _list(names: list[str]) -> str:
    return f"{len(names)} ({words(names)})" if names else "none"


def packing(stamp: dict) -> str:
    r, machine = stamp["result"], stamp["machine"]
    m, work = r["model"], r["workloads"]
    for w in work:  # the speed-ups are the best times' ratios, and every layout ran the same real tokens
        modes = w["modes"]
        for mode in modes.values():
            assert abs(mode["packed_speedup"] - mode["best_s"] / modes[PACKED]["best_s"]) < 1e-9
            assert mode["real"] == modes[PACKED]["real"] and mode["best_s"] == min(mode["times_s"])
    speedup = {_name(w): w["modes"][TODAY]["packed_speedup"] for w in work}
    best = max(speedup, key=speedup.get)
    skewed = [f"{w['modes'][TODAY]['packed_speedup']:.2f}x at `micro_batch_tokens` {w['budget']}" for w in work
              if (w["skew"], w["prompt"], w["G"]) == ("log-uniform", "long", 16)]  # fmt: skip
    reached = [name for name, s in speedup.items() if s >= TARGET]
    slower = [name for name, s in speedup.items() if s < 1 - BAND]
    even = [name for name, s in speedup.items() if 1 - BAND <= s <= 1 + BAND]
    sharing = {_name(w): w["modes"][UNSHARED]["best_s"] / w["modes"][TODAY]["best_s"] for w in work}
    share_loses = [name for name, s in sharing.items() if s < 1 - BAND]
    share_even = [name for name, s in sharing.items() if 1 - BAND <= s <= 1 + BAND]
    prose = (
        f"`{stamp['command']}` (published {stamp['date']} on {machine['cpus']} CPUs, load average "
        f"{machine['load_average'][0]}; wall time {num(r['wall_s'], 0)} s): CPU seconds of one gradient pass's "
        f"log-probs (forward and backward over the update's own micro-batches), best of {r['repeats']} rounds "
        f"after a warm-up, for a random Llama of hidden size {m['hidden']}, {m['layers']} layers, vocabulary "
        f"{num(m['vocab'], 0)} (fp32, SDPA, {r['threads']} thread), {r['rows']} rows per workload, completions "
        f"capped at {r['cap']} tokens. Workloads are named skew / prompt / G / `micro_batch_tokens`. "
        f"*Padded+shared* is the trimmed update before packing (`packing: false`, `share_prompts: true`), "
        f"*padded* the same without prompt sharing, *packed* `packing: true`; padding is 1 - real tokens / tokens "
        f"the forward computes (below 0 where shared prompts compute fewer than the real tokens).\n\n"
        f"The packed update's largest speed-up over the trimmed update is {speedup[best]:.2f}x ({best}); "
        + (f"it reaches {TARGET}x in {len(reached)} of {len(work)} workloads ({words(reached)}). "
           if reached else f"it reaches {TARGET}x in none of the {len(work)} workloads. ")
        + f"Packing does not pay: slower than the trimmed update by more than {BAND:.0%} in {_list(slower)}; within "
        f"{BAND:.0%} either way in {_list(even)}. Prompt sharing does not pay (padded+shared slower than the "
        f"padded one by more than {BAND:.0%}) in {_list(share_loses)}; within {BAND:.0%} either way in "
        f"{_list(share_even)}."
        + (" On the skewed workload of issue 34 (log-uniform completions, long prompts, G 16) the packed update's "
           f"speed-up over the trimmed update is {words(skewed)}." if skewed else "")
    )  # fmt: skip
    head = ["workload", "padding: padded+shared / padded / packed", "padded+shared (s)", "padded (s)", "packed (s)",
            "packed speed-up over padded+shared", "over padded"]  # fmt: skip
    rows = []
    for w in work:
        modes = w["modes"]
        pads = " / ".join(f"{modes[k]['padding_fraction']:.2f}" for k in (TODAY, UNSHARED, PACKED))
        times = [f"{modes[k]['best_s']:.2f}" for k in (TODAY, UNSHARED, PACKED)]
        rows.append([_name(w), pads, *times, f"{modes[TODAY]['packed_speedup']:.2f}",
                     f"{modes[UNSHARED]['packed_speedup']:.2f}"])  # fmt: skip
    return wrap(prose) + "\n" + table(head, rows) + "\n"
