"""Optimiser steps as a GPU run takes them: fp16 loss scaling before clipping, and the LR schedule's unit."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from estimators import GRPO
from sgrpo.model.tiny import ensure_tiny_model
from tests.engine_helpers import EXAMPLES, GradCapture, fixed_batch, run_steps
from tests.test_policy_gradients import MAX_NEW, PROMPTS, G, make_policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def batch(model_dir):
    return fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)


def one_clipped_sgd_step(model_dir, batch, plugins, optimizer) -> tuple[float, float]:
    """(logged grad norm, norm of the parameter change) of one step clipped to 1e-3 with lr 1."""
    policy = make_policy(model_dir, batch, GRPO(), max_grad_norm=1e-3, optimizer=optimizer)
    policy.configure_model()
    before = [p.detach().clone() for p in policy.model.parameters()]
    trainer = run_steps(policy, plugins=plugins)
    change = torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.model.parameters(), before)])
    return float(trainer.callback_metrics["train/grad_norm"]), float(change.norm())


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_mixed_gradients_are_unscaled_before_the_norm_and_the_clip(model_dir, batch, fused):
    """16-mixed scales the loss by 65,536. The norm must be taken and clipped after the GradScaler unscales:
    before the fix the logged norm was 87,878 (65,536 x 1.34) and the applied step 1.1e-8 instead of 1e-3.
    Fused AdamW unscales inside step(), after Lightning's hook, so the policy unscales it first."""
    if fused:
        optimizer = lambda p: torch.optim.AdamW(p, lr=1.0, fused=True, weight_decay=0.0)  # noqa: E731
    else:
        optimizer = lambda p: torch.optim.SGD(p, lr=1.0)  # noqa: E731
    fp32_norm, fp32_change = one_clipped_sgd_step(model_dir, batch, [], optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    fp16 = [MixedPrecision("16-mixed", "cpu", scaler)]  # Lightning turns precision="16-mixed" into bf16 on CPU
    fp16_norm, fp16_change = one_clipped_sgd_step(model_dir, batch, fp16, optimizer)
    assert fp32_norm > 1.0  # the clip to 1e-3 is active
    assert fp16_norm == pytest.approx(fp32_norm, rel=1e-2)
    if not fused:  # SGD applies the clipped gradient itself: a step of norm lr * 1e-3
        assert fp16_change == pytest.approx(1e-3, rel=1e-3) and fp32_change == pytest.approx(1e-3, rel=1e-3)
    else:  # Adam's first step is lr * sign(g) whatever the clip: the same step in both precisions
        assert fp16_change == pytest.approx(fp32_change, rel=1e-2)


def test_the_lr_schedule_steps_once_per_training_step(model_dir, batch):
    """4 optimiser steps per training step (2 PPO epochs x 2 mini-batches); a schedule sized by
    trainer.max_steps must count training steps, not optimiser steps (it ended 4x early)."""
    schedule = lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=4)  # noqa: E731
    policy = make_policy(
        model_dir, batch, GRPO(), ppo_epochs=2, num_minibatches=2, scheduler=schedule,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )  # fmt: skip
    run_steps(policy, steps=2)
    assert len(policy.captured) == 8
    scheduler = policy.lr_schedulers()
    assert scheduler.last_epoch == 2
    assert scheduler.get_last_lr() == pytest.approx([0.05])  # 0.1 x (1 - 2/4)


class Poisoned(GradCapture):
    """Makes the gradients NaN at the optimiser steps (counted from 0) in ``poison``, before the policy's hook."""

    def __init__(self, *args, poison=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poison, self.steps_seen = set(poison), 0

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.steps_seen in self.poison:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self.steps_seen += 1
        super().on_before_optimizer_step(optimizer)


def poisoned_policy(model_dir, batch, poison, **kwargs):
    sgd = lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)  # noqa: E731
    policy = make_policy(model_dir, batch, GRPO(), optimizer=sgd, **kwargs)
    policy.__class__ = Poisoned
    policy.poison, policy.steps_seen = set(poison), 0
    policy.configure_model()
    return policy


def test_a_non_finite_gradient_is_skipped_never_applied(model_dir, batch):
    """lr 1000 on configs/tiny.yaml gave NaN gradients from step 8 and trained (and exported) NaN weights, exit 0.
    A step whose gradient is not finite changes nothing (weights, momentum): two steps whose first is NaN end
    where one clean step ends, and the skip is logged."""
    clean = poisoned_policy(model_dir, batch, poison=())
    run_steps(clean, steps=1)
    policy = poisoned_policy(model_dir, batch, poison=(0,))
    trainer = run_steps(policy, steps=2)
    for got, want in zip(policy.model.parameters(), clean.model.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert float(trainer.callback_metrics["train/skipped_steps"]) == 0.0  # the last step's count
    assert policy.divergence_watch.skipped == 1 and policy.divergence_watch.streak == 0


def test_non_finite_steps_in_a_row_stop_the_run_naming_the_step_and_the_cause(model_dir, batch, tmp_path):
    """Three in a row (model.max_nonfinite_steps) stop the run; a run that ends on a skipped step is not exported."""
    from sgrpo.run.guards import DivergenceError

    policy = poisoned_policy(model_dir, batch, poison=(1, 2, 3))
    before = [p.detach().clone() for p in policy.model.parameters()]
    with pytest.raises(DivergenceError, match=r"diverged at step 4: .* 3 optimiser steps in a row.*lr 0.5"):
        run_steps(policy, steps=6)
    assert policy.rollout_step == 3  # steps 2-4 skipped: the weights are step 1's, finite
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(policy.model.parameters(), before, strict=True))
    policy = poisoned_policy(model_dir, batch, poison=(2,), max_nonfinite_steps=2)
    with pytest.raises(DivergenceError, match="ended at step 3 on 1 skipped optimiser step"):
        run_steps(policy, steps=3, root=str(tmp_path))
    assert not (tmp_path / "hf_model").exists()


def test_the_guards_streaks_travel_in_checkpoints(model_dir, batch):
    """A run that ended on a skipped step is refused its export; resuming its last.ckpt (no step left to train) used
    to export it, the streak back at 0. A resumed run counts on where the interrupted one stood, rewards too."""
    from sgrpo.run.guards import DivergenceError

    policy = poisoned_policy(model_dir, batch, poison=())
    policy.divergence_watch.observe(True, 3, "a learning rate too high (lr 0.5)")
    policy.reward_watch.streak = 2
    checkpoint = {}
    policy.on_save_checkpoint(checkpoint)
    resumed = poisoned_policy(model_dir, batch, poison=())
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.reward_watch.streak == 2
    with pytest.raises(DivergenceError, match=r"ended at step 3 on 1 skipped optimiser step.*\(lr 0.5\)"):
        resumed.divergence_watch.finish(3)
    fresh = poisoned_policy(model_dir, batch, poison=())
    fresh.on_load_checkpoint({"sgrpo": {"rollout_step": 3}})  # a checkpoint from before the streaks were kept
    assert (fresh.divergence_watch.streak, fresh.reward_watch.streak) == (0, 0)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_mixed_steps_with_no_gradient_anywhere_as_32_true_does(model_dir, batch, fused):
    """Every group constant under dynamic sampling: no process runs a backward. The GradScaler then raised (found by a
    review): "Attempted unscale_ but _scale is None" before its first scaled loss, "No inf checks were recorded"
    after. Now such a step passes over the parameters as 32-true does (none has a gradient: the weights stay) and
    leaves the scale as it was."""
    optimizer = lambda p: torch.optim.AdamW(p, lr=1e-3, fused=fused)  # noqa: E731
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    fp16 = [MixedPrecision("16-mixed", "cpu", scaler)]

    def idle_steps() -> None:
        constant = {p: [1.0] * G for p in PROMPTS}
        policy = make_policy(model_dir, batch, GRPO(), rewards=constant, dynamic_sampling=True, max_sampling_rounds=1,
                             optimizer=optimizer)  # fmt: skip
        policy.configure_model()
        before = [p.detach().clone() for p in policy.model.parameters()]
        assert run_steps(policy, steps=2, plugins=fp16).global_step == 2
        assert all(torch.equal(p, b) for p, b in zip(policy.model.parameters(), before))

    idle_steps()  # before the scaler's first scaled loss
    varied = make_policy(model_dir, batch, GRPO(), optimizer=optimizer)
    varied.configure_model()
    before = [p.detach().clone() for p in varied.model.parameters()]
    run_steps(varied, steps=1, plugins=fp16)
    assert not all(torch.equal(p, b) for p, b in zip(varied.model.parameters(), before))
    scale = scaler.get_scale()
    idle_steps()  # after it
    assert scaler.is_enabled() and scaler.get_scale() == scale
