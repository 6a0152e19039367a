"""Render of the tool quickstart's artefact (``benchmarks/tools_quickstart.py``): base against trained."""

from __future__ import annotations

import re

from benchmarks.figures._fmt import num, pct, signed, table, wrap


def _levels_mean(by_level: dict, levels: list[str]) -> float:
    return sum(by_level[n] for n in levels) / len(levels)


def tools_quickstart(stamp: dict) -> str:
    r, machine = stamp["result"], stamp["machine"]
    s, levels, runs = r["summary"], [str(n) for n in r["levels"]], r["runs"]
    for stage in ("base", "trained"):  # the summary is the mean over seeds of the runs' figures
        for metric in ("success", "tool_use"):
            for n in levels:
                assert abs(s[f"{stage}_{metric}"][n] - sum(x[stage][metric][n] for x in runs) / len(runs)) < 1e-3
    rows = []
    for n in [*levels, "mean"]:
        label = "mean over levels" if n == "mean" else f"{n} digit{'s' if n != '1' else ''}"
        cells = []
        for metric in ("success", "tool_use"):
            base, trained = s[f"base_{metric}"][n], s[f"trained_{metric}"][n]
            cells += [pct(base), pct(trained), f"{signed(100 * (trained - base))} pts"]
        rows.append([label, *cells])
    head = ["operands", "success base", "trained", "change", "tool use base", "trained", "change"]
    rose = {metric: sum(_levels_mean(x["trained"][metric], levels) > _levels_mean(x["base"][metric], levels)
                        for x in runs) for metric in ("success", "tool_use")}  # fmt: skip
    reward = s["train/reward"]
    tool_rate = s["train/episode/tool_use_rate"]
    fit = [x["fit_seconds"] for x in runs]
    jobs = re.search(r"--jobs (\d+)", stamp["command"])  # the script's default: 2
    prose = (
        f"`{stamp['command']}` (published {stamp['date']} on {machine['cpus']} CPUs at load average "
        f"{machine['load_average'][0]}): {len(runs)} seeds ({', '.join(str(x['seed']) for x in runs)}) of "
        f"`{r['config']}` for {r['steps']} steps each, every run's base and trained model measured alike on "
        f"{r['eval_prompts']} validation prompts per level and operation, {r['samples']} episodes each sampled "
        f"at temperature 1; means over seeds. Mean success over levels rose in {rose['success']} of {len(runs)} "
        f"seeds and tool use in {rose['tool_use']} of {len(runs)}. In training, the reward went from "
        f"{num(reward[0], 3)} (mean of the first {r['window']} steps) to {num(reward[1], 3)} (last {r['window']}) "
        f"and the share of episodes that call a tool from {num(tool_rate[0], 3)} to {num(tool_rate[1], 3)}. "
        f"A run's training took {num(min(fit), 0)}-{num(max(fit), 0)} s of wall clock, "
        f"{jobs[1] if jobs else 2} runs at a time."
    )
    return wrap(prose).rstrip("\n") + "\n\n" + table(head, rows) + "\n"
