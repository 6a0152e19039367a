"""Renders of the performance artefacts: gpu_hours, rewards, logprob_memory, throughput(_forced, _ablation,
_mmap)."""

from __future__ import annotations

import re

from benchmarks.figures._fmt import num, spread, table, wrap


def gpu_hours(stamp: dict) -> str:
    experiments = stamp["result"]["experiments"]
    groups: dict[tuple, list[str]] = {}  # a config and its _sim twin price the same: one row
    for name, e in experiments.items():
        groups.setdefault((e["gpus"], *e["gpu_hours"].values(), e["wall_hours_central"]), []).append(name)
    rows = []
    for names in sorted(
        groups.values(), key=lambda n: (experiments[n[0]]["gpus"], experiments[n[0]]["gpu_hours"]["central"])
    ):
        e = experiments[names[0]]
        h = e["gpu_hours"]
        rows.append([", ".join(sorted(names)), str(e["gpus"]),
                     f"{num(h['central'], 0)} [{num(h['low'], 0)}-{num(h['high'], 0)}]",
                     num(h["central_half_length"], 0), f"{num(e['wall_hours_central'], 1)} h"])  # fmt: skip
    total = sum(e["gpu_hours"]["central"] for e in experiments.values())
    head = ["experiment", "GPUs", "GPU-hours, central [range]", "at half the response cap", "run on its GPUs"]
    return (table(head, rows) + f"\n\nAll experiments once: {num(total, 0)} GPU-hours at the central assumptions "
            "(each GRPO baseline the same again).\n")  # fmt: skip


def rewards(stamp: dict) -> str:
    r, load = stamp["result"], stamp["machine"]["load_average"][0]
    pool = next(k for k in r if k.startswith("MathVerifyReward (pool of"))
    workers = pool.removeprefix("MathVerifyReward (pool of ").rstrip(")")
    one, two = r["DeepMath step: Task.score (one grading)"], r["DeepMath step: reward.score + successes (two gradings)"]
    assert one["seconds"] < two["seconds"], "grading once is no longer faster than grading twice"
    return wrap(
        f"Reward throughput, `{stamp['command']}` (published {stamp['date']} on {stamp['machine']['cpus']} CPUs at "
        f"load average {load} from other jobs: an idle machine is faster): math-verify grades "
        f"{r['deepmath_response_chars']}-character DeepMath responses at {num(r[pool]['per_s'], 0)} completions/s in "
        f"a pool of {workers} ({num(r['MathVerifyReward (in-process)']['per_s'], 0)}/s in-process); chrF "
        f"{num(r['ChrF `chrf`']['per_s'], 0)}/s, ROUGE-L {num(r['RougeL `rougeL`']['per_s'], 0)}/s, edit similarity "
        f"{num(r['EditSimilarity `edit`']['per_s'], 0)}/s. A training step grades each completion once (reward "
        f"and success from one grading, `Task.score`): DeepMath's grading of the batch in a pool of {workers} took "
        f"{one['seconds']:.3f} s, against {two['seconds']:.3f} s when the success test graded them again."
    )


def logprob_memory(stamp: dict) -> str:
    r = stamp["result"]
    chunked, full = r["chunked"]["peak_growth_mib"], r["full"]["peak_growth_mib"]
    assert abs(r["ratio"] - chunked / full) < 1e-9
    return wrap(
        f"`{stamp['command']}` (published {stamp['date']}): log-probs plus backward at Qwen's vocabulary "
        f"(151,936) for 8 x 512 tokens grow peak memory by {num(chunked, 0)} MiB through sgrpo's chunked LM head "
        f"against {num(full, 0)} MiB with full logits (ratio {r['ratio']:.3f})."
    )


def throughput(stamp: dict) -> str:
    r, machine = stamp["result"], stamp["machine"]
    s, t, ratio = r["sgrpo"], r["trl"], r["ratio"]
    forced = "--force-length" in stamp["command"]
    if forced:
        assert s["mean_len"] == t["mean_len"], "forced lengths differ between the frameworks"
        sgrpo, trl = spread(s["step_times_s"][1:]), spread(t["step_times_s"][1:])
        times = f"steps after the first from {sgrpo} s for sgrpo and {trl} s for TRL"
        return wrap(
            f"With every completion forced to {s['mean_len']:.0f} tokens, identical work on both sides, "
            f"`{stamp['command']}` (published {stamp['date']}, load average {machine['load_average'][0]}; wall time "
            f"{r['wall_s']:.0f} s; {times}): sgrpo's median step is {ratio['step_s']:.2f}x TRL's ({s['step_s']:.3f} "
            f"against {t['step_s']:.3f} s; rollout {ratio['rollout_s']:.2f}x, update {ratio['update_s']:.2f}x) at "
            f"{ratio['peak_mib']:.2f}x the peak RSS ({num(s['peak_mib'], 0)} against {num(t['peak_mib'], 0)} MiB)."
        )
    assert ratio["rollout_s"] < 1, "the rollout is no longer faster in sgrpo"
    load, cpus = machine["load_average"][0], machine["cpus"]
    sgrpo, trl = spread(s["step_times_s"]), spread(t["step_times_s"])
    ranges = f"each framework's steps ranged from {sgrpo} s (sgrpo) and {trl} s (TRL)"
    if load > cpus:  # other jobs shared the cores: the time rows are the load's
        conditions = (
            f"It ran next to other jobs (load average {load} on {cpus} CPUs at publication), and its **timings are the "
            f"load's more than the frameworks'**: {ranges}, far from what an idle machine gives, so the time rows "
            "below say little beyond the rollout being faster in sgrpo. Peak memory does not depend on the load."
        )
    else:
        conditions = f"It ran on a quiet machine (load average {load} on {cpus} CPUs at publication); {ranges}."
    prose = wrap(
        f"`{stamp['command']}` (published {stamp['date']}; N = {num(r['parameters'], 0)} parameters, 8 prompts x 8 "
        f"completions x 32 new tokens, EOS allowed, fp32, 2 threads, {r['warmup_steps']} warm-up + "
        f"{r['measured_steps']} measured steps each). {conditions}"
    )
    rows = [("median step time (s)", "step_s", 3), ("rollout: time in generate (s)", "rollout_s", 3),
            ("update: rest of the step (s)", "update_s", 3), ("mean completion length (tokens)", "mean_len", 1),
            ("peak RSS (MiB)", "peak_mib", 0)]  # fmt: skip
    body = [[label, num(s[key], d), num(t[key], d), f"{ratio[key]:.2f}"] for label, key, d in rows]
    return prose + "\n" + table(["", "sgrpo", "TRL", "sgrpo / TRL"], body) + "\n"


def throughput_ablation(stamp: dict) -> str:
    """The ablation case: sgrpo as configured and with one optimisation undone per variant (steps alternating)."""
    r, machine = stamp["result"], stamp["machine"]
    variants = {k: v for k, v in r.items() if isinstance(v, dict) and "peak_mib" in v}
    first, last = "sgrpo as configured", "none of these"  # the artefact's keys are sorted: the script's order back
    order = [first, *sorted(set(variants) - {first, last}), last]
    variants = {k: variants[k] for k in order}
    base = variants["sgrpo as configured"]
    lean = variants["MLP keeps its four activations (lean_mlp off)"]
    assert lean["peak_mib"] > base["peak_mib"], "the lean MLP no longer lowers the peak"
    load, cpus = machine["load_average"][0], machine["cpus"]
    busy = " (other jobs shared the cores: the time columns are the load's)" if load > cpus else ""
    prose = wrap(
        f"`{stamp['command']}` (published {stamp['date']}, load average {load} on {cpus} CPUs{busy}; wall time "
        f"{r['wall_s']:.0f} s): sgrpo on the workload above, as configured and with one optimisation undone per "
        f"variant, every variant in its own process, steps alternating. The lean MLP (`model.lean_mlp`) lowers the "
        f"peak RSS from {num(lean['peak_mib'], 0)} to {num(base['peak_mib'], 0)} MiB "
        f"({num(lean['peak_mib'] - base['peak_mib'], 0)} MiB less)"
        + (f"; without the lean norms (`model.lean_norm`) the peak is {num(norm['peak_mib'], 0)} MiB."
           if (norm := variants.get("norms keep their normalised input (lean_norm off)")) else ".")
    )
    rows = [[label, f"{v['step_s']:.3f}", f"{v['vs_configured']:.2f}x", f"{v['rollout_s']:.3f}", f"{v['update_s']:.3f}",
             num(v["peak_mib"], 0)] for label, v in variants.items()]  # fmt: skip
    head = ["variant", "step (s)", "vs configured", "rollout (s)", "update (s)", "peak RSS (MiB)"]
    return prose + "\n" + table(head, rows) + "\n"


def throughput_mmap(stamp: dict) -> str:
    """The throughput workload with glibc's mmap threshold fixed in both workers: peak RSS as memory in use, and what
    AdamW's states and the gradients alone take of the room a 0.5x ratio leaves."""
    r, machine = stamp["result"], stamp["machine"]
    s, t, ratio = r["sgrpo"], r["trl"], r["ratio"]
    threshold = int(re.search(r"--malloc-mmap-threshold[ =](\d+)", stamp["command"]).group(1))
    state = 3 * 4 * r["parameters"] / 2**20  # fp32 gradients and AdamW's two moments, MiB
    room = t["peak_mib"] / 2 - s["setup_rss_mib"]
    assert s["peak_mib"] - s["setup_rss_mib"] > state, "sgrpo's step adds less than its optimiser state"
    prose = wrap(
        f"`{stamp['command']}` (published {stamp['date']}, load average {machine['load_average'][0]} on "
        f"{machine['cpus']} CPUs; wall time {r['wall_s']:.0f} s): the workload above with glibc's mmap threshold "
        f"fixed at {num(threshold, 0)} bytes in both workers, so that every freed block above it goes back to the OS "
        f"at once and the peak RSS is the memory in use, not what the allocator keeps. sgrpo's peak is "
        f"{ratio['peak_mib']:.2f}x TRL's ({num(s['peak_mib'], 0)} against {num(t['peak_mib'], 0)} MiB). At 0.5x "
        f"sgrpo's step could add {num(room, 0)} MiB to its RSS after setup ({num(s['setup_rss_mib'], 0)} MiB, "
        f"{ratio['setup_rss_mib']:.2f}x TRL's: torch, transformers and Lightning imported, the model loaded), where "
        f"the fp32 gradients and AdamW's two moments of the {num(r['parameters'], 0)} parameters take "
        f"{num(state, 0)} MiB on either side, before any activation. The fixed threshold costs time (page faults): "
        f"median steps of {s['step_s']:.3f} s (sgrpo) and {t['step_s']:.3f} s (TRL), so the time figures are the "
        "default run's above."
    )
    rows = [("peak RSS (MiB)", s["peak_mib"], t["peak_mib"]),
            ("RSS after setup (MiB)", s["setup_rss_mib"], t["setup_rss_mib"]),
            ("peak RSS - RSS after setup (MiB)", s["peak_mib"] - s["setup_rss_mib"],
             t["peak_mib"] - t["setup_rss_mib"])]  # fmt: skip
    body = [[label, num(a, 0), num(b, 0), f"{a / b:.2f}"] for label, a, b in rows]
    return prose + "\n" + table(["", "sgrpo", "TRL", "sgrpo / TRL"], body) + "\n"
