"""The policy's gradient against hand-derived references (docs/policy_loss.md §7) and its invariance to batch
splitting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from estimators import GRPO, SoftmaxGRPO
from sgrpo.model.logprobs import position_ids_from_mask
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.train.loss import AGGREGATIONS, ClippedSurrogate
from tests.engine_helpers import EXAMPLES, FixedRollout, FixedTask, GradCapture, PresetReward, fixed_batch, run_steps

G, MAX_NEW = 4, 6
PROMPTS = [ex.prompt for ex in EXAMPLES[:4]]
# group 0 mixed, group 1 constant (no gradient), group 2 one success, group 3 graded
REWARDS = {
    PROMPTS[0]: [1.0, 0.0, 1.0, 0.0],
    PROMPTS[1]: [1.0, 1.0, 1.0, 1.0],
    PROMPTS[2]: [0.0, 0.0, 0.0, 1.0],
    PROMPTS[3]: [0.2, 0.9, 0.5, 0.0],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def batch(model_dir):
    return fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)


def make_policy(model_dir, batch, estimator, rewards=REWARDS, **kwargs) -> GradCapture:
    task = FixedTask(PresetReward(rewards), EXAMPLES[:4])
    defaults = dict(
        group_size=G, prompts_per_step=4, max_grad_norm=None, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), seed=0
    )
    return GradCapture(str(model_dir), task, estimator, FixedRollout(batch, PROMPTS, MAX_NEW), **(defaults | kwargs))


def surrogate(aggregation: str, rows: int = 4) -> ClippedSurrogate:
    """ClippedSurrogate with ``aggregation``; micro_batch_token_mean's loss groups of ``rows`` rows."""
    grouped = aggregation == "micro_batch_token_mean"
    return ClippedSurrogate(aggregation=aggregation, micro_batch_rows=rows if grouped else None)


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_t17_seq_sum_const_gradient_is_the_reinforce_sum(model_dir, batch):
    """At ratio 1, kl 0, seq_sum_const: grad = -sum_i A_i grad log pi(o_i) / (N * L_max)."""
    estimator = SoftmaxGRPO(temperature=0.5)
    policy = make_policy(model_dir, batch, estimator, loss=ClippedSurrogate(aggregation="seq_sum_const"))
    run_steps(policy)
    got = flat(policy.captured[0])

    rewards = torch.tensor([REWARDS[p] for p in PROMPTS])  # [B, G]
    adv = estimator(rewards).reshape(-1)  # [N]
    assert torch.all(adv.view(4, G)[1] == 0)  # the constant group has exactly zero advantage
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    p, t = batch.prompt_length, batch.completion_mask.shape[1]
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids_from_mask(batch.attention_mask),
    ).logits[:, p - 1 : -1]
    token_logp = logits.log_softmax(-1).gather(-1, batch.input_ids[:, p:].unsqueeze(-1)).squeeze(-1)
    seq_logp = (token_logp * batch.completion_mask).sum(-1)  # [N] log pi(o_i)
    n = batch.input_ids.shape[0]
    (-(adv.float() * seq_logp).sum() / (n * MAX_NEW)).backward(retain_graph=True)
    want = flat({name: q.grad for name, q in model.named_parameters()})
    assert rel_err(got, want) < 1e-6

    # constant groups add nothing: the same sum without group 1's rows gives the same gradient
    model.zero_grad()
    keep = torch.ones(n, dtype=torch.bool)
    keep[G : 2 * G] = False
    (-(adv.float() * seq_logp)[keep].sum() / (n * MAX_NEW)).backward()
    assert rel_err(got, flat({name: q.grad for name, q in model.named_parameters()})) < 1e-6
    assert t <= MAX_NEW


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_is_independent_of_micro_batching(model_dir, batch, aggregation):
    grads, chunks = [], []
    width = batch.prompt_length + batch.completion_mask.shape[1]
    # 16 rows in one piece; in 4-row micro-batches; in micro-batches of at most 3 full-width rows' tokens; padded,
    # then packed (sgrpo.model.packing) with the same three splits, then packed with each group's prompt once
    # (micro_batch_token_mean's loss groups of 3 rows cross the memory micro-batches' bounds)
    splits = ((None, None), (4, None), (None, 3 * width))
    for packing, share in ((False, False), (True, False), (True, True)):
        for rows, tokens in splits:
            policy = make_policy(
                model_dir, batch, GRPO(), loss=surrogate(aggregation, rows=3), micro_batch_size=rows,
                micro_batch_tokens=tokens, packing=packing, share_prompts=share,
            )
            run_steps(policy)
            grads.append(flat(policy.captured[0]))
            mask = batch.completion_mask
            chunks.append(policy._micro_batches(batch, torch.arange(len(mask)), mask))
    assert grads[0].norm() > 0
    for other in grads[1:]:
        assert rel_err(other, grads[0]) < 1e-6
    assert [len(c) for c in chunks[0]] == [16] and [len(c) for c in chunks[1]] == [4, 4, 4, 4]
    lengths = batch.completion_mask.sum(-1)
    assert len(chunks[2]) > 1
    for chunk in chunks[2]:  # within the token budget, longest rows first
        assert len(chunk) * (batch.prompt_length + int(lengths[chunk].max())) <= 3 * width
    torch.testing.assert_close(torch.cat(chunks[2]).sort().values, torch.arange(16), rtol=0, atol=0)
    assert lengths[torch.cat(chunks[2])].tolist() == sorted(lengths.tolist(), reverse=True)
    # packed, prompts not shared: balanced bins of real tokens (prompt + completion up to the last), each within
    # the budget (shared, a bin's tokens count each group's prompt once: the gradients above are equal all the same)
    real = (batch.attention_mask[:, : batch.prompt_length].sum(-1) + lengths - 1).tolist()
    assert [len(c) for c in chunks[3]] == [16] and [len(c) for c in chunks[4]] == [4, 4, 4, 4]
    loads = [sum(real[i] for i in c.tolist()) for c in chunks[5]]  # a tiny model: cost ~ tokens (+ L^2 / 6H)
    assert len(loads) > 1 and max(loads) <= 3 * width and max(loads) - min(loads) <= max(real)
    torch.testing.assert_close(torch.cat(chunks[5]).sort().values, torch.arange(16), rtol=0, atol=0)


def test_dynamic_sampling_drops_constant_groups_from_the_update(model_dir, batch):
    # group 1 is constant: with dynamic sampling the update equals one over groups 0, 2, 3 alone
    policy = make_policy(model_dir, batch, GRPO(), dynamic_sampling=True, max_sampling_rounds=1)  # no refill
    trainer = run_steps(policy)
    assert float(trainer.callback_metrics["train/zero_variance_groups"]) == 0.25
    kept = [0, 2, 3]
    rows = torch.tensor([g * G + j for g in kept for j in range(G)])
    sub = type(batch)(
        batch.input_ids[rows],
        batch.attention_mask[rows],
        batch.completion_mask[rows],
        [batch.completions[i] for i in rows.tolist()],
        batch.truncated[rows],
        G,
    )
    prompts = [PROMPTS[g] for g in kept]
    examples = [ex for ex in EXAMPLES[:4] if ex.prompt in prompts]
    reference = GradCapture(
        str(model_dir),
        FixedTask(PresetReward(REWARDS), examples),
        GRPO(),
        FixedRollout(sub, prompts, MAX_NEW),
        group_size=G,
        prompts_per_step=3,
        max_grad_norm=None,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
    )
    run_steps(reference)
    assert rel_err(flat(policy.captured[0]), flat(reference.captured[0])) < 1e-6


def test_dynamic_sampling_refills_the_batch_with_informative_groups(model_dir, batch):
    """Round 1 keeps groups 0, 2, 3 (group 1 is constant); round 2 samples the 4 prompts again (the step drew them
    all: the refill reads them all anew) and the first informative group tops the batch up to prompts_per_step = 4."""
    seen: list[tuple[int, torch.Tensor]] = []
    for _ in range(2):  # twice: the refilled step is a pure function of (seed, step)
        policy = make_policy(model_dir, batch, GRPO(), dynamic_sampling=True)
        update = policy.update
        policy.update = lambda rollout, advantages, keep, update=update: (
            seen.append((rollout.num_groups, advantages.clone())) or update(rollout, advantages, keep)
        )
        trainer = run_steps(policy)
    metrics = trainer.callback_metrics
    assert float(metrics["train/sampling/rounds"]) == 2 and float(metrics["train/sampling/groups_dropped"]) == 2
    assert float(metrics["train/zero_variance_groups"]) == 2 / 8  # of every sampled group
    (groups, advantages), (_, again) = seen
    assert groups == 4 and torch.equal(advantages, again)
    assert (advantages.abs().sum(-1) > 0).all()  # all four are informative


def test_a_refill_never_draws_a_prompt_the_step_already_drew(model_dir, batch):
    """4 prompts, 2 a step, 2 of them constant: a step that drew one or both needs a refill, which draws the prompts
    the step has not (the refill stream was a permutation of its own: a step held a prompt twice, or redrew one just
    dropped as constant)."""
    rewards = REWARDS | {PROMPTS[2]: [0.0] * G}  # groups 1 and 2 constant
    policy = make_policy(model_dir, batch, GRPO(), rewards, prompts_per_step=2, dynamic_sampling=True)
    drawn: list[list[str]] = []  # each step's prompts, round after round
    sample = policy.sample
    policy.sample = lambda examples, sampling_round=0: (
        (drawn[-1] if sampling_round else drawn.append([]) or drawn[-1]).extend(ex.prompt for ex in examples)
        or sample(examples, sampling_round)
    )
    run_steps(policy, steps=8)
    assert len(drawn) == 8 and any(len(step) > 2 for step in drawn)  # refills happened
    assert all(len(set(step)) == len(step) for step in drawn), drawn


def test_a_batch_of_only_constant_groups_makes_an_empty_update(model_dir, batch):
    task = FixedTask(PresetReward({p: [1.0] * G for p in PROMPTS}), EXAMPLES[:4])
    policy = GradCapture(
        str(model_dir),
        task,
        GRPO(),
        FixedRollout(batch, PROMPTS, MAX_NEW),
        group_size=G,
        prompts_per_step=4,
        dynamic_sampling=True,
        micro_batch_size=3,
    )
    trainer = run_steps(policy)
    assert float(trainer.callback_metrics["train/grad_norm"]) == 0.0
    assert float(trainer.callback_metrics["train/zero_variance_groups"]) == 1.0


def test_ppo_epochs_and_minibatches_take_several_optimiser_steps_per_training_step(model_dir, batch):
    policy = make_policy(
        model_dir,
        batch,
        GRPO(),
        ppo_epochs=2,
        num_minibatches=2,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        loss=ClippedSurrogate(clip_low=0.1, clip_high=0.1),
    )
    trainer = run_steps(policy, steps=2)
    assert len(policy.captured) == 8  # 2 training steps x 2 epochs x 2 mini-batches
    assert trainer.global_step == 2  # max_steps counts training steps (rollout batches)
    assert policy.rollout_step == 2
    # later mini-batches are off-policy: the ratio moved, so some tokens hit the clip
    metrics = trainer.callback_metrics
    assert float(metrics["train/clip/low"]) + float(metrics["train/clip/high"]) > 0


def test_kl_to_a_frozen_reference(model_dir, batch):
    # step 1: policy == reference, so k3 = 0 and its gradient vanishes: same gradient as kl_coef 0
    plain = make_policy(model_dir, batch, GRPO())
    run_steps(plain)
    with_kl = make_policy(
        model_dir, batch, GRPO(), loss=ClippedSurrogate(kl_coef=0.5), optimizer=lambda p: torch.optim.SGD(p, lr=0.5)
    )
    trainer = run_steps(with_kl, steps=2)
    assert rel_err(flat(with_kl.captured[0]), flat(plain.captured[0])) < 1e-6
    assert float(trainer.callback_metrics["train/kl"]) > 0  # step 2: the policy has moved away
    assert "_reference" not in dict(with_kl.named_modules())  # not trained, not checkpointed
    assert not any(k.startswith("_reference") for k in with_kl.state_dict())


def test_auto_micro_batch_budget_on_cpu(model_dir, batch):
    """micro_batch_tokens="auto" (the default) cuts CPU micro-batches at 1,024 padded tokens, longest rows first."""
    from sgrpo.train.batching import AUTO_MICRO_BATCH_TOKENS
    from sgrpo.types import RolloutBatch

    policy = make_policy(model_dir, batch, GRPO(), packing=False)  # packed bins: tests/test_packing.py
    assert policy.micro_batch_tokens == "auto" and AUTO_MICRO_BATCH_TOKENS["cpu"] == 1024
    lengths = torch.randint(1, 41, (48,), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(40).unsqueeze(0) < lengths.unsqueeze(-1)  # [48, 40]
    rollout = RolloutBatch(
        input_ids=torch.zeros(48, 50, dtype=torch.long),
        attention_mask=torch.ones(48, 50, dtype=torch.long),
        completion_mask=mask,
        completions=[""] * 48,
        truncated=torch.zeros(48, dtype=torch.bool),
        group_size=8,
    )
    chunks = policy._micro_batches(rollout, torch.arange(48), mask)
    assert len(chunks) > 1 and torch.equal(torch.cat(chunks).sort().values, torch.arange(48))
    for chunk in chunks:
        assert len(chunk) * (10 + int(lengths[chunk].max())) <= 1024


def test_rows_with_zero_advantage_are_counted_but_not_run(model_dir, batch):
    """The constant group's 4 rows are not forwarded; the denominators still count them (T17 checks the value)."""
    forwarded: dict[float, list[int]] = {}
    for kl_coef in (0.0, 0.1):
        policy = make_policy(
            model_dir, batch, GRPO(), loss=ClippedSurrogate(kl_coef=kl_coef), micro_batch_tokens=None, packing=False
        )
        policy.configure_model()
        sizes = forwarded.setdefault(kl_coef, [])
        handle = policy.model.model.register_forward_pre_hook(
            lambda _m, _a, kwargs, sizes=sizes: (
                sizes.append(kwargs["input_ids"].shape[0]) if torch.is_grad_enabled() else None
            ),
            with_kwargs=True,
        )
        run_steps(policy)
        handle.remove()
        logged = policy.trainer.logged_metrics
        assert float(logged["train/update/rows_skipped"]) == (4.0 if kl_coef == 0 else 0.0)
    # the update's forwards: the distinct prompts once, then the rows on their KV cache
    assert forwarded == {0.0: [3, 12], 0.1: [4, 16]}


class PerturbedPolicy(GradCapture):
    """A policy that starts away from its KL reference (both load the same folder; the policy gets noise)."""

    def configure_model(self) -> None:
        super().configure_model()
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def test_kl_gradient_pulls_the_policy_towards_the_reference(model_dir, batch):
    """With every group constant (advantage 0) the gradient is the KL term's alone, and it is not zero:
    grad of kl_coef * sum_t k3_t / num_tokens, k3 = exp(ref - logp) - (ref - logp) - 1 (token_mean).
    d k3 / d logp = 1 - exp(ref - logp): a flipped sign in the policy's loss gives rel err 2."""
    kl_coef = 0.5
    task = FixedTask(PresetReward({p: [1.0] * G for p in PROMPTS}), EXAMPLES[:4])
    policy = PerturbedPolicy(
        str(model_dir), task, GRPO(), FixedRollout(batch, PROMPTS, MAX_NEW), group_size=G, prompts_per_step=4,
        loss=ClippedSurrogate(kl_coef=kl_coef), max_grad_norm=None, optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
    )  # fmt: skip
    run_steps(policy)
    got = flat(policy.captured[0])

    def token_logp(model) -> torch.Tensor:  # [N, T] log pi(o_t | ...) of the batch's completion tokens
        p = batch.prompt_length
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
        ).logits[:, p - 1 : -1]
        return logits.log_softmax(-1).gather(-1, batch.input_ids[:, p:].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        ref = token_logp(AutoModelForCausalLM.from_pretrained(model_dir))
    model = policy.model  # its weights are unchanged (lr 0)
    model.zero_grad()
    mask = batch.completion_mask.float()
    d = ref - token_logp(model)
    k3 = torch.exp(d) - d - 1
    (kl_coef * (k3 * mask).sum() / mask.sum()).backward()
    want = flat({name: q.grad for name, q in model.named_parameters()})
    assert want.norm() > 0 and float((k3 * mask).sum()) > 0  # the policy does differ from the reference
    assert rel_err(got, want) < 1e-5


def test_training_logs_the_log_mgf_objective(model_dir, batch):
    """train/log_mgf = mean over groups of tau log mean_j exp(r_j / tau): at log_mgf_temperature for any estimator,
    at SoftmaxGRPO's own tau by default, absent otherwise. By hand, at tau = 1: groups 0 (two 1s, two 0s) and 2
    (one 1) give log((1 + e) / 2) and log((3 + e) / 4), group 1 (all 1) gives 1, group 3 log(mean e^r)."""
    import math

    def by_hand(tau):
        groups = [REWARDS[p] for p in PROMPTS]
        return sum(tau * math.log(sum(math.exp(r / tau) for r in g) / len(g)) for g in groups) / len(groups)

    assert by_hand(1.0) == pytest.approx(
        (math.log((1 + math.e) / 2) + 1 + math.log((3 + math.e) / 4)
         + math.log((math.exp(0.2) + math.exp(0.9) + math.exp(0.5) + 1) / 4)) / 4)  # fmt: skip
    for estimator, setting, tau in ((GRPO(), 1.0, 1.0), (SoftmaxGRPO(0.25), None, 0.25), (GRPO(), None, None)):
        trainer = run_steps(make_policy(model_dir, batch, estimator, log_mgf_temperature=setting))
        logged = trainer.callback_metrics.get("train/log_mgf")
        if tau is None:
            assert logged is None
        else:
            assert float(logged) == pytest.approx(by_hand(tau), rel=1e-6)
    with pytest.raises(ValueError, match="log_mgf_temperature"):
        make_policy(model_dir, batch, GRPO(), log_mgf_temperature=0.0)


class ExternalRollout(FixedRollout):
    """The fixed rows as an external sampler (vLLM) gives them: its own log-probs, a little off the trainer's."""

    samples_from_policy = False

    def generate(self, model, tokenizer, examples, group_size, greedy=False):
        rows = super().generate(model, tokenizer, examples, group_size, greedy)
        return dataclasses.replace(rows, logprobs=(rows.completion_mask * -0.1).float())


def test_importance_sampling_off_runs_no_forward_at_the_sampling_weights(model_dir, batch, monkeypatch):
    """The paper's recipes (importance_sampling_cap null, as verl 0.6.1 ran): an external sampler's log-probs feed
    the metrics only, so the update runs no forward for old log-probs and its gradient is the on-policy one; with
    sgrpo's truncated IS (cap 2) the trainer's forward at the sampling weights runs, once per step."""
    grads, forwards = {}, {}
    for name, cap, engine in (("on-policy", None, FixedRollout), ("off", None, ExternalRollout),
                              ("tis", 2.0, ExternalRollout)):  # fmt: skip
        policy = make_policy(model_dir, batch, GRPO(), loss=ClippedSurrogate(importance_sampling_cap=cap))
        policy.rollout = engine(batch, PROMPTS, MAX_NEW)
        calls = []
        monkeypatch.setattr(policy, "_logprobs", lambda *a, _f=policy._logprobs, _c=calls: _c.append(1) or _f(*a))
        run_steps(policy)
        grads[name], forwards[name] = flat(policy.captured[0]), len(calls)
    assert forwards == {"on-policy": 0, "off": 0, "tis": 1}
    assert rel_err(grads["off"], grads["on-policy"]) < 1e-6
    assert rel_err(grads["tis"], grads["on-policy"]) > 1e-3  # weights min(e^{old + 0.1}, 2) reweigh the tokens
