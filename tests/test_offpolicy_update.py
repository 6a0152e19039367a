"""The update on stale rows (RolloutBatch.versions older than the trainer's step): exactly today's path at staleness
0, the decoupled objective's importance weights against a float64 reference from the two weight snapshots, the
bypass mode, and the train/offpolicy/* metrics (docs/policy_loss.md §7.7)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from estimators import GRPO
from sgrpo.model.logprobs import position_ids_from_mask
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.train.correction import TokenMask
from sgrpo.train.loss import ClippedSurrogate
from tests.engine_helpers import EXAMPLES, FixedRollout, GradCapture, fixed_batch, run_steps
from tests.test_policy_gradients import MAX_NEW, PROMPTS, REWARDS, G, flat, make_policy  # noqa: F401

OFFPOLICY_KEYS = {
    "train/offpolicy/ess", "train/offpolicy/k3", "train/offpolicy/masked_fraction",
    "train/offpolicy/masked_sequence_fraction", "train/offpolicy/truncated_fraction", "train/offpolicy/weight_mean",
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def batch(model_dir):
    """Rows the HF engine sampled at the initial weights (version 0), with its float32 log-probs."""
    rows = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    assert rows.logprobs is not None
    return rows


class VersionedRollout(FixedRollout):
    """Replays the fixed rows as an async producer delivers them: the sampler's log-probs and a version per row
    (``version`` None: no versions, today's synchronous batches)."""

    def __init__(self, batch, version: int | None, logprobs: bool = True):
        super().__init__(batch, PROMPTS, MAX_NEW)
        self.version, self.logprobs = version, logprobs

    def generate(self, model, tokenizer, examples, group_size, greedy=False):
        rows = super().generate(model, tokenizer, examples, group_size, greedy)
        order = torch.tensor([PROMPTS.index(ex.prompt) * G + j for ex in examples for j in range(G)])
        versions = None if self.version is None else torch.full((len(order),), self.version, dtype=torch.long)
        return dataclasses.replace(rows, logprobs=self.batch.logprobs[order] if self.logprobs else None,
                                   versions=versions)  # fmt: skip


class HalfStaleRollout(VersionedRollout):
    """Prompts 2 and 3 sampled a step ago (version -1, so a process may hold only current rows), prompts 0 and 1
    now; behaviour log-probs shifted by ``0.2 cos(t + 3 row)`` so that the importance weights spread over
    [0.82, 1.22]. The same rows and versions whichever process asks for them (tests/sharded_worker.py)."""

    def __init__(self, batch):
        super().__init__(batch, 0)
        n, t = batch.logprobs.shape
        phase = torch.arange(t).unsqueeze(0) + 3 * torch.arange(n).unsqueeze(-1)
        self.shifted = batch.logprobs + 0.2 * torch.cos(phase.float()) * batch.completion_mask

    def generate(self, model, tokenizer, examples, group_size, greedy=False):
        rows = super().generate(model, tokenizer, examples, group_size, greedy)
        order = torch.tensor([PROMPTS.index(ex.prompt) * G + j for ex in examples for j in range(G)])
        return dataclasses.replace(rows, logprobs=self.shifted[order], versions=-(order >= 2 * G).long())


def half_stale_loss() -> ClippedSurrogate:
    """Truncation at 1.1 and a token mask below 0.85: both bite on ``HalfStaleRollout``'s weights."""
    return ClippedSurrogate(importance_sampling_cap=1.1, corrections=[TokenMask(low=0.85, high=10.0)])


class Recording(ClippedSurrogate):
    """ClippedSurrogate that keeps every importance weight it applies, with the behaviour log-probs of its rows."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.step = 0  # the trainer's step (Snapshots sets it)

    def importance(self, batch):
        weights = super().importance(batch)
        self.seen.append((self.step, batch.sampler_logp.clone(), weights.weight.clone(), batch.mask.clone()))
        return weights


class Snapshots(GradCapture):
    """Keeps the weights each update starts from, and each update's logs."""

    def update(self, rollout, advantages, keep_groups):
        self.snapshots.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        self.loss.step = self.rollout_step
        self.logs.append(super().update(rollout, advantages, keep_groups))
        return self.logs[-1]


def policy_with(model_dir, batch, rollout, loss=None, cls=GradCapture, **kwargs):
    policy = make_policy(model_dir, batch, GRPO(), loss=loss or ClippedSurrogate(), **kwargs)
    policy.__class__ = cls  # the same policy, with the recording hooks
    policy.snapshots, policy.logs = [], []
    policy.rollout = rollout
    return policy


def count_forwards(policy, monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(policy, "_logprobs", lambda *a, _f=policy._logprobs: calls.append(1) or _f(*a))
    return calls


def test_staleness_zero_is_exactly_the_on_policy_update(model_dir, batch, monkeypatch):
    """versions all equal to the trainer's step: the same forwards, loss and gradient bit for bit as no versions;
    a stale version (a row from step -1) takes the decoupled path and its metrics, in one optimiser step without
    a proximal forward (the gradient pass's own log-probs are the proximal ones)."""
    runs = {}
    for name, version in (("sync", None), ("k=0", 0), ("stale", -1)):
        policy = policy_with(model_dir, batch, VersionedRollout(batch, version), cls=Snapshots)
        calls = count_forwards(policy, monkeypatch)
        run_steps(policy)
        runs[name] = (flat(policy.captured[0]), policy.logs[0], len(calls))
        # the sampler-trainer gap's jump warning watches current batches only (staleness moves the gap by design)
        assert (getattr(policy, "_gap_watch", None) is None) == (name == "stale"), name
    (grad, logs, forwards), (grad0, logs0, forwards0) = runs["sync"], runs["k=0"]
    assert torch.equal(grad, grad0) and grad.norm() > 0 and forwards == forwards0 == 0
    assert set(logs) == set(logs0) and not OFFPOLICY_KEYS & set(logs)
    assert all(torch.equal(logs[k], logs0[k]) for k in logs if "throughput" not in k)  # loss, kl, clip, ...
    stale_grad, stale_logs, stale_forwards = runs["stale"]
    assert stale_forwards == 0 and set(stale_logs) >= OFFPOLICY_KEYS
    # at the same weights the HF sampler's float32 log-probs and the trainer's agree closely: w ~ 1, ESS ~ 1
    assert float(stale_logs["train/offpolicy/ess"]) == pytest.approx(1.0, abs=1e-6)
    assert float(stale_logs["train/offpolicy/k3"]) < 1e-9
    assert (stale_grad - grad).norm() < 1e-5 * grad.norm()


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_a_stale_update_runs_the_proximal_forward_only_when_it_takes_more_than_one_optimiser_step(
    model_dir, batch, monkeypatch, ppo_epochs
):
    """Half the rows a step old, importance weights over [0.82, 1.22] that the cap and the mask bite on. One pass of
    one optimiser step: no proximal forward, and the gradient, loss and train/offpolicy/* equal those of the same
    update with the forward forced (the gradient pass runs at the proximal weights). Two epochs: the forward runs
    (the second pass's weights are no longer the proximal ones)."""
    runs = {}
    for forced in (False, True):
        policy = policy_with(model_dir, batch, HalfStaleRollout(batch), loss=half_stale_loss(), cls=Snapshots,
                             ppo_epochs=ppo_epochs, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # fmt: skip
        if forced:
            monkeypatch.setattr(policy, "_needs_proximal_forward", lambda external, stale: True)
        calls = count_forwards(policy, monkeypatch)
        run_steps(policy)
        runs[forced] = (torch.stack([flat(g) for g in policy.captured]), policy.logs[0], len(calls))
    (grad, logs, forwards), (want, want_logs, want_forwards) = runs[False], runs[True]
    assert (forwards, want_forwards) == ((0, 1) if ppo_epochs == 1 else (1, 1))
    assert float(logs["train/offpolicy/truncated_fraction"]) > 0 and float(logs["train/offpolicy/masked_fraction"]) > 0
    assert (grad - want).norm() <= 1e-6 * want.norm() and want.norm() > 0
    for key in (*OFFPOLICY_KEYS, "train/loss"):
        assert float(logs[key]) == pytest.approx(float(want_logs[key]), rel=1e-6, abs=1e-7), key


def float64_logprobs(model_dir, state: dict, batch) -> torch.Tensor:
    """Log-probs ``[N, T]`` of the completion tokens at the weights ``state``, in float64."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    p = batch.prompt_length
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
        ).logits[:, p - 1 : -1]  # fmt: skip
    return logits.log_softmax(-1).gather(-1, batch.input_ids[:, p:].unsqueeze(-1)).squeeze(-1)


def test_importance_weights_equal_the_float64_reference_of_the_two_snapshots(model_dir, batch):
    """Rows sampled at version 0 and trained at steps 1 and 2 (k = 1, 2 optimiser steps later, SGD lr 0.1): the
    weights the loss applies, exp(proximal - behaviour) with no cap, equal exp(logp_64(theta_k) - logp_64(theta_0))
    within 1e-6 relative (float32's precision: an error of 1e-6 in the log-ratio), and they are far from 1 (the
    check can fail)."""
    loss = Recording(importance_sampling_cap=None)
    policy = policy_with(
        model_dir, batch, VersionedRollout(batch, 0), loss=loss, cls=Snapshots,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )  # fmt: skip
    run_steps(policy, steps=3)
    assert len(policy.snapshots) == 3 and len(loss.seen) >= 2  # step 0 is on-policy: no weights
    behaviour64 = float64_logprobs(model_dir, policy.snapshots[0], batch)
    mask = batch.completion_mask
    # the HF sampler's float32 log-probs are the float64 forward at version 0 (the contract's behaviour)
    assert float((batch.logprobs.double() - behaviour64)[mask].abs().max()) < 1e-5
    checked, largest, error = 0, 0.0, 0.0
    for k in (1, 2):
        want = torch.exp(float64_logprobs(model_dir, policy.snapshots[k], batch) - behaviour64)  # float64 reference
        for sampler, weight, row_mask in (seen[1:] for seen in loss.seen if seen[0] == k):
            t = sampler.shape[1]
            for r in range(sampler.shape[0]):  # find each recorded row by its behaviour log-probs
                match = [i for i in range(len(mask)) if torch.equal(batch.logprobs[i, :t], sampler[r])]
                assert match, "a recorded row is not in the batch"
                m = row_mask[r]
                got = weight[r][m].double()
                error = max(error, float((got - want[match[0], :t][m]).abs().max()))
                largest = max(largest, float((got - 1).abs().max()))
                checked += int(m.sum())
        assert float(policy.logs[k]["train/offpolicy/ess"]) < 1.0
    print(f"checked {checked} tokens: largest |w - 1| {largest:.4f}, largest error {error:.2e}")
    assert error <= 1e-6
    assert checked > 20 and largest > 1e-2


def test_a_stale_batch_needs_the_samplers_logprobs(model_dir, batch):
    policy = policy_with(model_dir, batch, VersionedRollout(batch, -1, logprobs=False))
    with pytest.raises(ValueError, match="RolloutBatch.logprobs"):
        run_steps(policy)


def test_bypass_anchors_ppo_on_the_behaviour_logprobs(model_dir, batch, monkeypatch):
    """bypass: no proximal forward, no importance weight, rho = exp(logp - behaviour); at staleness 0 the
    gradient is the on-policy one up to the sampler's float32 noise (rho ~ 1)."""
    grads = {}
    bypass = ClippedSurrogate(importance_sampling_cap=None, bypass=True)
    for name, loss, version in (("sync", ClippedSurrogate(), None), ("bypass", bypass, -1)):
        policy = policy_with(model_dir, batch, VersionedRollout(batch, version), loss=loss, cls=Snapshots)
        calls = count_forwards(policy, monkeypatch)
        run_steps(policy)
        grads[name] = flat(policy.captured[0])
        assert len(calls) == 0 and not OFFPOLICY_KEYS & set(policy.logs[0])
    assert not torch.equal(grads["bypass"], grads["sync"])  # the anchor is the sampler's log-probs, not logp
    assert (grads["bypass"] - grads["sync"]).norm() < 1e-4 * grads["sync"].norm()
    assert math.isfinite(float(grads["bypass"].norm()))


def test_corrections_and_bypass_are_chosen_in_the_config(model_dir, tmp_path, monkeypatch):
    """ClippedSurrogate's corrections are classes named in YAML, after the cap's TokenTruncation, in order."""
    import yaml

    from sgrpo.fit import parse
    from sgrpo.train import GeometricMeanMask, K3Rejection, TokenTruncation

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    raw = yaml.safe_load((repo / "configs/tiny.yaml").read_text())
    corrections = [{"class_path": "sgrpo.train.GeometricMeanMask", "init_args": {"low": 0.9, "high": 1.1}},
                   {"class_path": "sgrpo.train.K3Rejection", "init_args": {"threshold": 0.05}}]  # fmt: skip
    raw["model"]["loss"] = {"class_path": "sgrpo.train.ClippedSurrogate", "init_args": {"corrections": corrections}}
    config = tmp_path / "offpolicy.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = ["--config", str(config), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path}"]
    loss = parse(args).model.loss
    assert [type(c) for c in loss.corrections] == [TokenTruncation, GeometricMeanMask, K3Rejection]
    assert (loss.corrections[1].low, loss.corrections[1].high, loss.corrections[2].threshold) == (0.9, 1.1, 0.05)
    bypass = parse([*args, "--model.loss.init_args.corrections=[]", "--model.loss.init_args.bypass=true"]).model.loss
    assert bypass.bypass and [type(c) for c in bypass.corrections] == [TokenTruncation]
