"""GPU-hours of each SoftmaxGRPO paper experiment (``configs/paper/*.yaml``): an estimate, not a measurement.

No step of these runs has been timed on a GPU. The only GPU step time on record is the quickstart's on one H200
(60 steps in 22 s, docs/scaling.md, a session before 2026-11-30): a 132K-parameter model whose step is ~2e9
FLOPs, so its 0.37 s are fixed per-step overhead (kernel launches, Python), about 1e-5 of the GPU's peak; scaled
by FLOPs to a 1.5B model it would predict months per step, so it is printed and not used. The 0.44B FSDP2 smoke
fit of ``benchmarks/gpu_smoke.py`` ran on that H200 too, but its tokens/s were not recorded. This script
therefore prices each experiment with a FLOPs model at a stated model-FLOP utilisation (MFU) instead:

- per step, ``R = prompts_per_step x group_size`` rows of ``p`` prompt tokens (an assumption per task, below)
  and ``r`` response tokens (the cap ``max_new_tokens``, "at most"; half the cap as a second case);
- generation: ``2 N`` FLOPs per token (prompts prefilled once per prompt, responses decoded per row);
- training, per row token ``p + r``: ``6 N`` (forward and backward), ``+ 2 N`` recompute under activation
  checkpointing, ``+ 2 N`` the trainer's forward at the sampling weights when an external sampler (vLLM)
  samples and the loss weighs it (``importance_sampling_cap`` not null or other ``corrections``, and no
  ``bypass``), or
  when a step takes several optimiser steps (``ppo_epochs`` or ``num_minibatches`` > 1), ``+ 2 N`` the KL
  reference's forward when ``kl_coef > 0``;
- attention's quadratic term, which ``2 N`` leaves out: ``2 n_layers d_attn t`` FLOPs per token forward at
  context position ``t`` (QK^T and AV), taken at the mean position of a row (``p + r / 2``), times 3 in training;
- validation: ``1 + max_steps // val_check_interval`` generations of the held-out prompts x ``val_samples``, one
  more at the last step with ``validate_last`` when the interval does not fall on it;
- seconds = generation FLOPs / (peak x MFU_gen) + training FLOPs / (peak x MFU_train), peak = the H200's
  989 TFLOP/s dense bf16; GPU-hours assume perfect data-parallel scaling (wall time = GPU-hours / GPUs).

``--measured NAME=SECONDS`` calibrates on a measured step of experiment NAME (its central estimate is scaled
to the measurement, and every other experiment by the same factor): the first GPU run replaces the MFU guess.

    python benchmarks/gpu_hours.py            # prints the table and publishes benchmarks/reports/gpu_hours
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.artefact import publish  # noqa: E402

PAPER = ROOT / "configs" / "paper"
#: dense bf16 peak of one H200 SXM (the H100 SXM's tensor cores), FLOP/s
PEAK = 989e12
#: assumed model-FLOP utilisation (low, central, high): batched vLLM decoding of a 1-4B model is bound by memory
#: bandwidth, the FSDP2 update by matmuls; neither is measured under sgrpo
MFU = {"generation": (0.05, 0.10, 0.20), "training": (0.20, 0.30, 0.40)}
#: hub id -> (parameters N, layers, attention width heads x head_dim), from the models' cards and config.json
#: (tied embeddings: the LM head's matmul is N's embedding share, so the total counts)
MODELS = {
    "Qwen/Qwen2.5-1.5B": (1.54e9, 28, 12 * 128),
    "Qwen/Qwen3-1.7B-Base": (1.7e9, 28, 16 * 128),
    "Qwen/Qwen3-4B-Base": (4.0e9, 36, 32 * 128),
}
#: task -> assumed mean prompt tokens (question + the paper's instruction and system prompt + chat markup)
PROMPT_TOKENS = {"tasks.GSM8K": 110, "tasks.Countdown": 110, "tasks.CountdownGold": 110, "tasks.DeepMath": 130,
                 "tasks.OpenThoughts": 350, "tasks.Polaris": 130}  # fmt: skip
#: validation prompts where the config leaves them to the source: GSM8K's official test split; AIME 2025 (30)
#: and MATH-500 (500) for Polaris
SOURCE_VALIDATION = {"tasks.GSM8K": 1319, "tasks.Polaris": 530}
#: distinct training prompts of the sources whose configs stop on epochs (Polaris-53K less the evaluation matches)
TRAIN_PROMPTS = {"tasks.Polaris": 53_000}
#: the one GPU step time on record (docs/scaling.md): why it cannot be scaled
QUICKSTART_H200 = {"steps": 60, "seconds": 22.0, "parameters": 132e3, "rows": 16 * 8, "tokens_per_row": 18,
                   "source": "docs/scaling.md: one H200, a session before 2026-11-30"}  # fmt: skip


def quickstart_rate() -> dict:
    """The quickstart's measured H200 step and the FLOP rate it implies (training 6N + generation 2N per token)."""
    q = QUICKSTART_H200
    step = q["seconds"] / q["steps"]
    flops = 8 * q["parameters"] * q["rows"] * q["tokens_per_row"]
    return {"step_s": step, "flops_per_step": flops, "flop_rate": flops / step, "share_of_peak": flops / step / PEAK}


def attention_flops(model: str, context: float) -> float:
    """Forward FLOPs per token of attention's scores and weighted sum at context length ``context``."""
    _, layers, width = MODELS[model]
    return 2 * layers * width * context


def experiment(raw: dict, fill: float = 1.0) -> dict:
    """FLOPs per step and in all of one paper config ``raw``, responses at ``fill`` x the cap."""
    m, trainer = raw["model"], raw["trainer"]
    task = m["task"]["class_path"]
    n = MODELS[m["model"]][0]
    prompts, group = m["prompts_per_step"], m["group_size"]
    rows = prompts * group
    p, r = PROMPT_TOKENS[task], fill * m["rollout"]["init_args"]["max_new_tokens"]
    loss = m.get("loss", {}).get("init_args", {})
    external = m["rollout"]["class_path"].endswith("VLLMRollout")
    capped = loss.get("importance_sampling_cap", 2.0) is not None or bool(loss.get("corrections"))  # default cap 2
    weighted = external and capped and not loss.get("bypass", False)  # bypass: the sampler's log-probs, no forward
    old_pass = weighted or m.get("ppo_epochs", 1) > 1 or m.get("num_minibatches", 1) > 1
    passes = {"forward and backward": 6, "activation recompute": 2 if m.get("activation_checkpointing") else 0,
              "forward at the sampling weights": 2 if old_pass else 0,
              "KL reference forward": 2 if loss.get("kl_coef", 0) > 0 else 0}  # fmt: skip
    factor = sum(passes.values())
    attention = attention_flops(m["model"], p + r / 2)  # per token forward, at the mean position
    generation = 2 * n * (prompts * p + rows * r) + attention * (prompts * p + rows * r)
    training = rows * (p + r) * (factor * n + factor / 2 * attention)  # attention's backward: 2x its forward
    steps = run_steps(trainer, task, prompts)
    interval = trainer["val_check_interval"]
    validations = 1 + steps // interval + (1 if raw.get("validate_last") and steps % interval else 0)
    val_prompts = m["task"].get("init_args", {}).get("validation_size") or SOURCE_VALIDATION[task]
    val_r = fill * (m.get("val_rollout") or m["rollout"])["init_args"]["max_new_tokens"]
    val_attention = attention_flops(m["model"], p + val_r / 2)
    val_samples = 1 if m.get("val_greedy") else m["val_samples"]  # greedy: one completion a prompt
    validation = (2 * n + val_attention) * val_prompts * (p + val_samples * val_r) * validations
    gpus = trainer["devices"] * trainer.get("num_nodes", 1)
    return {"model": m["model"], "parameters": n, "gpus": gpus, "steps": steps, "rows": rows, "prompt_tokens": p,
            "response_tokens": r, "generated_tokens_per_step": rows * r, "trained_tokens_per_step": rows * (p + r),
            "training_passes": passes, "generation_flops_per_step": generation, "training_flops_per_step": training,
            "validations": validations, "validation_prompts": val_prompts, "validation_flops": validation,
            "attention_share": attention / (2 * n + attention)}  # fmt: skip


def run_steps(trainer: dict, task: str, prompts_per_step: int) -> int:
    """``trainer.max_steps``, or for a run bounded by epochs (``max_steps: -1``) ``max_epochs`` x
    ceil(N / prompts_per_step) with N the source's distinct training prompts (``TRAIN_PROMPTS``, approximate)."""
    if trainer.get("max_steps", -1) > 0:
        return trainer["max_steps"]
    return trainer["max_epochs"] * math.ceil(TRAIN_PROMPTS[task] / prompts_per_step)


def gpu_hours(cost: dict, mfu_gen: float, mfu_train: float, scale: float = 1.0) -> float:
    """GPU-hours of an ``experiment`` at the given utilisations (``scale``: a calibration factor)."""
    generation = cost["steps"] * cost["generation_flops_per_step"] + cost["validation_flops"]
    seconds = generation / (PEAK * mfu_gen) + cost["steps"] * cost["training_flops_per_step"] / (PEAK * mfu_train)
    return scale * seconds / 3600


def estimate(configs: dict[str, dict], measured: tuple[str, float] | None = None) -> dict:
    """Every experiment's cost and GPU-hours (low, central, high), at the cap and at half the cap."""
    central = (MFU["generation"][1], MFU["training"][1])
    scale = 1.0
    if measured is not None:
        name, seconds = measured
        cost = experiment(configs[name])
        step_hours = gpu_hours({**cost, "steps": 1, "validation_flops": 0.0}, *central) / cost["gpus"]
        scale = seconds / 3600 / step_hours
    out = {}
    for name, raw in configs.items():
        cost, half = experiment(raw), experiment(raw, fill=0.5)
        hours = {"high": gpu_hours(cost, MFU["generation"][0], MFU["training"][0], scale),
                 "central": gpu_hours(cost, *central, scale),
                 "low": gpu_hours(cost, MFU["generation"][2], MFU["training"][2], scale),
                 "central_half_length": gpu_hours(half, *central, scale)}  # fmt: skip
        step = gpu_hours({**cost, "steps": 1, "validation_flops": 0.0}, *central, scale) * 3600 / cost["gpus"]
        out[name] = {**cost, "gpu_hours": hours, "step_seconds_central": step,
                     "wall_hours_central": hours["central"] / cost["gpus"]}  # fmt: skip
    return {"experiments": out, "calibration": scale, "measured": list(measured) if measured else None}


def report(result: dict) -> str:
    q = quickstart_rate()
    lines = ["# GPU-hours of the paper's experiments (an estimate from a FLOPs model, not a measurement)", "",
             "No step of these runs has been timed on a GPU. The one GPU step time on record, the quickstart on one "
             f"H200 ({QUICKSTART_H200['steps']} steps in {QUICKSTART_H200['seconds']:.0f} s), is "
             f"{q['step_s']:.2f} s for {q['flops_per_step']:.1e} FLOPs: {q['flop_rate'] / 1e9:.1f} GFLOP/s, "
             f"{q['share_of_peak']:.0e} of the peak, fixed overhead that does not scale with FLOPs, so it is not "
             "used. Instead: FLOPs per step (2N per generated token; 6N per trained token, +2N recompute, +2N the "
             "forward at the sampling weights under vLLM with importance sampling (off in the paper's configs), "
             "+2N the KL reference; attention's quadratic term added) "
             f"at an assumed MFU of {MFU['generation'][1]:.0%} for generation ({MFU['generation'][0]:.0%}-"
             f"{MFU['generation'][2]:.0%}) and {MFU['training'][1]:.0%} for training ({MFU['training'][0]:.0%}-"
             f"{MFU['training'][2]:.0%}) of an H200's {PEAK / 1e12:.0f} TFLOP/s; responses at the cap (at most) "
             "and at half the cap; perfect data-parallel scaling.", ""]  # fmt: skip
    if result["measured"]:
        name, seconds = result["measured"]
        lines += [f"Calibrated on a measured step of {name}: {seconds:g} s (factor {result['calibration']:.3g}).", ""]
    lines += ["| experiment | model | GPUs | steps | rows x (prompt + response) tokens per step | TFLOPs per step, "
              "generation / training | GPU-hours, central [range] | at half the cap | step (s) and run (h) on "
              "its GPUs |", "|---|---|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, e in result["experiments"].items():
        h = e["gpu_hours"]
        lines.append(
            f"| {name} | {e['model'].split('/')[1]} ({e['parameters'] / 1e9:.2f}B) | {e['gpus']} | {e['steps']:,} | "
            f"{e['rows']:,} x ({e['prompt_tokens']:,} + {e['response_tokens']:,.0f}) | "
            f"{e['generation_flops_per_step'] / 1e12:,.0f} / {e['training_flops_per_step'] / 1e12:,.0f} | "
            f"{h['central']:,.0f} [{h['low']:,.0f}-{h['high']:,.0f}] | {h['central_half_length']:,.0f} | "
            f"{e['step_seconds_central']:.0f} s, {e['wall_hours_central']:.1f} h |"
        )
    total = sum(e["gpu_hours"]["central"] for e in result["experiments"].values())
    lines += ["", f"All experiments once, central, responses at the cap: {total:,.0f} GPU-hours (each GRPO baseline "
              "costs the same again).", "", "Assumed mean prompt tokens: " + ", ".join(
                  f"{k.split('.')[1]} {v}" for k, v in PROMPT_TOKENS.items()) + ". Parameters: the model cards'. "
              "Validation: the held-out prompts x val_samples, before training, every val_check_interval steps "
              "and at the last step (validate_last; included in the GPU-hours)."]  # fmt: skip
    return "\n".join(lines)


def load_configs() -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(PAPER.glob("*.yaml"))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", help="NAME=SECONDS: a measured step time of experiment NAME on its GPUs")
    parser.add_argument("--no-publish", action="store_true", help="print only")
    args = parser.parse_args(argv)
    measured = None
    if args.measured:
        name, _, seconds = args.measured.partition("=")
        measured = (name, float(seconds))
    result = estimate(load_configs(), measured)
    text = report(result)
    print(text)
    if not args.no_publish:
        command = ".venv/bin/python benchmarks/gpu_hours.py" + (f" --measured {args.measured}" if args.measured else "")
        publish("gpu_hours", {**result, "quickstart_h200": quickstart_rate(), "mfu": MFU, "peak": PEAK,
                              "prompt_tokens": PROMPT_TOKENS}, text, command)  # fmt: skip
    return result


if __name__ == "__main__":
    main()
