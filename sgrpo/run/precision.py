"""The weights' precision against the optimiser: refusals of float16 and bfloat16 weights whose steps round away.

``check_weight_precision`` runs on the precision the trainer resolved, before any model loads, on a stand-in
parameter (``stand_in_optimizer``), and reads the learning-rate schedule (``scheduled_lr_below``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from sgrpo.checks import ConfigError


def stand_in_optimizer(policy: Any) -> torch.optim.Optimizer:
    """The configured optimiser, built on a stand-in parameter (nothing has loaded yet)."""
    try:
        return policy.optimizer_factory([torch.nn.Parameter(torch.zeros(1, device="cpu"))])
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.optimizer: {err}") from None


#: the dtype a "-true" precision converts the weights to; other precisions train them in ``model.dtype``
_CONVERTED = {"16-true": "float16", "bf16-true": "bfloat16", "64-true": "float64"}
#: trainer.precision -> the dtype Lightning's autocast computes in around each step
_AUTOCAST = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}


def sampling_precision(precision: str) -> tuple[str | None, str | None]:
    """(the dtype Lightning converts the whole module to, buffers included, or None; autocast's dtype around a step,
    or None) under ``precision``: what a process sampling outside the trainer (the async producer) must apply to a
    model loaded as the trainer's was, to sample the same policy."""
    return _CONVERTED.get(precision), _AUTOCAST.get(precision)

#: the learning rate below which bfloat16 rounds away an Adam-family step of a typical weight: bfloat16 keeps
#: 8 significant bits, so w + d differs from w only where |d| > |w| * 2^-9 at least (half a unit in the last
#: place); Adam's step is about lr, and |w| ~ 0.02 (the usual initializer_range) gives 0.02 * 2^-9 = 3.9e-5
BF16_MIN_ADAM_LR = 0.02 * 2**-9


def check_weight_precision(precision: str, policy: Any, max_steps: int | None = None) -> None:
    """Refuse low-precision weights that an optimiser with an ``eps`` (one that normalises its step by squared
    gradients: Adam, AdamW, RMSprop, ...) cannot train.

    float16 weights: a squared gradient below 6e-8 (a gradient below 2.4e-4) is 0, so such a step divides
    by ``eps`` alone: after one ``16-true`` AdamW step (eps 1e-4) the quickstart model's weights had moved by
    up to 54x the learning rate and every reward after was 0; with eps 1e-8, which float16 rounds to 0, the
    gradient norm was NaN from the second step.

    bfloat16 weights at ``lr < BF16_MIN_ADAM_LR`` (3.9e-5): the step, about ``lr``, is below half a unit in
    the last place of a weight of magnitude 0.02, so it rounds away. Measured on the tiny model (N(0, 0.02)
    weights, AdamW, 10 steps): 98.0 % of the weights never changed at lr 1e-6, 84.8 % at 1e-5, 45 % at 4e-5,
    15 % at 1e-4, 0.8 % at 1e-3. float32 master weights (``bf16-mixed`` with ``model.dtype`` float32) keep
    every step. Evaluation in either dtype is not refused. The bound is checked on the base learning rate;
    a scheduler (``model.scheduler``) that drives it below the bound within ``max_steps`` training steps gets
    a warning naming the step from which the updates round away (``scheduled_lr_below``).
    """
    dtype = _CONVERTED.get(precision, policy.model_dtype)
    source = f"trainer.precision={precision}" if precision in _CONVERTED else f"model.dtype={policy.model_dtype}"
    if dtype not in ("float16", "bfloat16"):
        return
    optimizer = stand_in_optimizer(policy)
    if "eps" not in optimizer.defaults:
        return
    name = type(optimizer).__name__
    if dtype == "float16":
        raise ConfigError(
            f"{source} trains float16 weights, whose squared gradients in {name} round to 0 "
            "and wreck the model in a step: use --trainer.precision=16-mixed (float32 weights, loss scaling) on "
            "a GPU without bfloat16, else bf16-mixed or bf16-true, with model.dtype float32 or bfloat16"
        )
    lr = min(float(group["lr"]) for group in optimizer.param_groups)
    if lr < BF16_MIN_ADAM_LR:
        raise ConfigError(
            f"{source} trains bfloat16 weights at lr {lr:g}, where {name}'s steps round away: a step moves a "
            f"weight by about lr, and bfloat16 (8 significant bits) changes a weight w only by more than "
            f"|w| * 2^-9, so for |w| ~ 0.02 an lr below {BF16_MIN_ADAM_LR:.1e} is lost (98% of the tiny model's "
            f"weights never moved in 10 AdamW steps at lr 1e-6): use --trainer.precision=bf16-mixed with "
            f"--model.dtype=float32 (float32 master weights), or an lr of at least {BF16_MIN_ADAM_LR:.1e}"
        )
    below = scheduled_lr_below(policy, optimizer, BF16_MIN_ADAM_LR, max_steps)
    if below is not None:
        rank_zero_warn(
            f"{source} trains bfloat16 weights, and model.scheduler takes the lr to {below[1]:.3g} at step "
            f"{below[0]}, below {BF16_MIN_ADAM_LR:.1e}, where {name}'s steps round away (|w| * 2^-9 for |w| ~ 0.02): "
            "from there on most weights stop moving; --trainer.precision=bf16-mixed with --model.dtype=float32 "
            "keeps every step"
        )


#: at most this many scheduler steps are simulated (an endless run's schedule is read that far)
SCHEDULE_STEPS_READ = 100_000


def scheduled_lr_below(policy: Any, optimizer: torch.optim.Optimizer, bound: float, max_steps: int | None):
    """(step, lr) of the first training step at which ``policy``'s scheduler, stepped once per training step
    on the stand-in ``optimizer``, sets a learning rate below ``bound``; None if it never does (or no
    scheduler)."""
    factory = getattr(policy, "scheduler_factory", None)
    if factory is None:
        return None
    steps = SCHEDULE_STEPS_READ if max_steps is None or max_steps < 0 else min(max_steps, SCHEDULE_STEPS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing trains here
        try:
            scheduler = factory(optimizer)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.scheduler: {err}") from None
        for step in range(steps):
            lr = min(float(group["lr"]) for group in optimizer.param_groups)
            if lr < bound:
                return step, lr
            scheduler.step()
    return None
