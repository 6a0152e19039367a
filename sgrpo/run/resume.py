"""What a resume may change: the experiment a checkpoint was trained as, against the config it resumes with.

A checkpoint records its run's ``model`` block and seed, flattened to ``key: value`` lines
(``experiment_record``). A resume whose config differs in any of them (another estimator, group size, task,
reward, loss, learning rate, ...) trains another experiment into the same metrics file, so it is refused in
one line naming each change, unless the user asks for it with ``--resume_changes allow``. Allowed, every
change is applied: the policy, task and estimator are built from the new config anyway, and the optimiser's
settings, which loading the optimiser state would silently put back to the old ones (a new learning rate was
ignored), are set again from the new config (``apply_optimizer_settings``).

Settings that change how a step is computed, not what it computes, may change freely (``OPERATIONAL``):
micro-batching, memory and logging options, and the evaluation's own settings.
"""

from __future__ import annotations

import json
from typing import Any

#: ``model.*`` keys a resume may change without changing the experiment (prefixes match their sub-keys)
OPERATIONAL = (
    "model.micro_batch_size", "model.micro_batch_tokens", "model.logits_chunk_mib", "model.share_prompts",
    "model.activation_checkpointing", "model.gradient_sync", "model.log_completions_every",
    "model.log_completions_groups", "model.export_dir", "model.val_rollout", "model.val_samples",
    "model.val_greedy", "model.val_prompts_per_batch", "model.reward_failure_share", "model.reward_failure_steps",
    "model.task.init_args.workers", "model.task.init_args.reward.init_args.workers",
    "model.task.init_args.verifier.init_args.workers", "model.rollout.init_args.max_batch_rows",
    "model.optimizer.init_args.fused", "model.optimizer.init_args.foreach",  # one kernel or a dozen: the same step
)


class ResumeError(Exception):
    """A checkpoint that loaded but cannot continue in this run (another optimiser, or another experiment).

    Every process raises it at the same point (the checkpoint and the config are the same on each), so over
    several processes it takes the ordinary path of a refused run (``sgrpo.run.faults.EVERY_PROCESS``): one line,
    exit 2, as on one process."""


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}", out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True, default=str)


def experiment_record(model, seed) -> dict[str, str]:
    """The parsed config's ``model`` block (a jsonargparse namespace or a dict) and seed as
    ``{"model.group_size": "8", ...}`` (values as JSON text), without the ``OPERATIONAL`` keys."""
    record: dict[str, str] = {}
    _flatten(model.as_dict() if hasattr(model, "as_dict") else dict(model), "model", record)
    record["seed_everything"] = json.dumps(seed, default=str)
    return {k: v for k, v in record.items() if not k.startswith(OPERATIONAL)}


def experiment_changes(trained: dict[str, str], resumed: dict[str, str]) -> list[str]:
    """``key: old -> new`` for every key whose value differs (``unset`` where one side lacks it); a class that
    changed is one line, without its arguments."""
    keys = [k for k in sorted(set(trained) | set(resumed)) if trained.get(k) != resumed.get(k)]
    classes = tuple(k.removesuffix("class_path") + "init_args." for k in keys if k.endswith(".class_path"))
    return [f"{k}: {trained.get(k, 'unset')} -> {resumed.get(k, 'unset')}" for k in keys if not k.startswith(classes)]


def apply_optimizer_settings(optimizers, schedulers) -> None:
    """Set every parameter group's settings (lr, weight decay, betas, ...) from its optimiser's ``defaults``, the
    new config's, over those the loaded state put back; a scheduler's base learning rates follow."""
    for optimizer in optimizers:
        lr = optimizer.defaults["lr"]
        for group in optimizer.param_groups:
            group.update({k: v for k, v in optimizer.defaults.items() if k in group and k not in ("params", "lr")})
            if "initial_lr" in group:  # scheduled: the step's lr in the new base's proportion
                group["lr"], group["initial_lr"] = group["lr"] * lr / group["initial_lr"], lr
            else:
                group["lr"] = lr
    for config in schedulers:
        scheduler = getattr(config, "scheduler", config)
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]
