"""Device-agnostic code: no tensor of the step is made on torch's default device by accident.

The first GPU run crashed at step 1 on ``torch.full(shape, 5)`` (no ``device=``) meeting a CUDA tensor.
CPU tests cannot see that, because the default device *is* the CPU. Here the default device is the
``meta`` device while the model and every input stay on the CPU: a tensor made without a device then
lands on ``meta`` and the first operation mixing it with a real tensor raises (PyTorch refuses even
0-dim meta/CPU mixes, which CUDA would allow), so each such factory is caught where it runs. A
static check covers code that CPU tests do not run (the vLLM engine's GPU path).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from estimators import SoftmaxGRPO, budget_mass, budget_shares
from sgrpo.eval.passk import pass_at_k
from sgrpo.model.logprobs import logprob_mismatch
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.train.batching import micro_batches
from sgrpo.train.loss import ClippedSurrogate, clipped_surrogate, k3_kl, tis_weights, token_weights
from tasks.synthetic import SyntheticTask
from tests.engine_helpers import run_steps

REPO = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = str(REPO / "sgrpo" / "assets" / "quickstart_model")


class ForeignDefaultDevice(GRPOPolicy):
    """Runs training and validation with torch's default device set to ``meta`` (the model stays on CPU).

    Lightning's own logging builds its metric state on the default device, so ``log`` runs on the CPU
    default; that is Lightning's code, not the step's.
    """

    def training_step(self, examples, batch_idx):
        with torch.device("meta"):
            return super().training_step(examples, batch_idx)

    def validation_step(self, examples, batch_idx):
        with torch.device("meta"):
            return super().validation_step(examples, batch_idx)

    def on_validation_epoch_end(self):
        with torch.device("meta"):
            return super().on_validation_epoch_end()

    def log(self, *args, **kwargs):
        with torch.device("cpu"):
            return super().log(*args, **kwargs)


OFF_POLICY_WITH_KL = {"ppo_epochs": 2, "loss": ClippedSurrogate(kl_coef=0.1), "dynamic_sampling": True}


@pytest.mark.parametrize("extra", [{}, OFF_POLICY_WITH_KL])
def test_training_and_validation_run_with_a_foreign_default_device(extra):
    """Rollout (lean decoder), rewards, estimator, budget metrics, update, validation and pass@k."""
    task = SyntheticTask(kind="sort", levels=[3, 5], num_train=64, num_validation=8)
    policy = ForeignDefaultDevice(
        SHIPPED_MODEL, task, SoftmaxGRPO(temperature=0.5), HFRollout(max_new_tokens=8), group_size=4,
        prompts_per_step=4, val_samples=2, **extra,
    )  # fmt: skip
    trainer = run_steps(policy, steps=2, limit_val_batches=1, val_check_interval=1)
    metrics = trainer.callback_metrics
    assert policy.rollout_step == 2 and "val/pass@2" in metrics and "train/budget/l1/hard" in metrics
    assert all(p.device.type == "cpu" for p in policy.model.parameters())


def test_maths_follows_its_inputs_device():
    """Budget, pass@k, loss pieces and batching keep the inputs' device whatever the default device is
    (every estimator is checked in tests/test_estimators_conformance.py)."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.2, 0.9, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    logp, old = -torch.rand(3, 5), -torch.rand(3, 5)
    mask = torch.rand(3, 5) > 0.3
    adv, correct, rows = torch.randn(3), torch.tensor([0, 2, 4]), torch.arange(3)
    with torch.device("meta"):
        outputs = [SoftmaxGRPO(temperature=0.5)(rewards)]
        outputs += list(budget_shares(budget_mass(outputs[0], rewards.mean(-1))).values())
        outputs.append(pass_at_k(correct, 4, 2))
        outputs += list(clipped_surrogate(logp, old, adv, 0.2, 0.3))
        outputs += [k3_kl(logp, old), token_weights(mask, "seq_sum_const", 3, 9, 5), tis_weights(logp, old, mask, 2)]
        outputs += list(logprob_mismatch(logp, old, mask).values())
        outputs += micro_batches(rows, mask.sum(-1), 4, 2, 12)
    assert all(out.device.type == "cpu" for out in outputs)


#: torch functions that make a new tensor on the default device unless told otherwise
FACTORIES = {
    "arange", "as_tensor", "empty", "eye", "full", "linspace", "logspace", "ones", "rand", "randint",
    "randn", "randperm", "scalar_tensor", "tensor", "zeros",
}  # fmt: skip


def test_library_tensor_factories_name_their_device():
    """Every ``torch.<factory>(...)`` in the engine and the estimators says where its tensor goes
    (``device=``; ``device="cpu"`` for host-side tensors), or is written as ``x.new_*`` / ``*_like``."""
    missing = []
    for folder in ("sgrpo", "estimators"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                if (
                    isinstance(node, ast.Call)
                    and isinstance(func, ast.Attribute)
                    and func.attr in FACTORIES
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)
                ):
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: torch.{func.attr}(...)")
    assert not missing, "tensor factories without device=:\n" + "\n".join(missing)
