"""The policy loss as a component: ClippedSurrogate by hand, and a user's loss class chosen in a config."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from sgrpo.fit import main
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, PolicyLoss, TokenBatch, k3_kl, loss_groups

REPO = Path(__file__).resolve().parents[1]


def two_rows(**kwargs) -> TokenBatch:
    # row 0: 2 tokens, advantage +1; row 1: 1 token (the second is padding), advantage -1
    logp = torch.tensor([[0.5, 0.0], [-0.5, 9.0]], requires_grad=True)
    fields = {"old_logp": torch.zeros(2, 2), "advantages": torch.tensor([1.0, -1.0])}
    fields["mask"] = torch.tensor([[True, True], [True, False]])
    return TokenBatch(logp=logp, **(fields | kwargs))


def test_clipped_surrogate_by_hand():
    # ratios: e^0.5 = 1.6487 (A = +1: clipped at 1.28, its gradient is 0), e^0 = 1 (A = +1: -1),
    # e^-0.5 = 0.6065 (A = -1: clipped at 0.8 from below: -(0.8 x -1) = 0.8, gradient 0)
    # per-token loss [-1.28, -1.0, 0.8]; token_mean over 3 tokens (of the whole mini-batch: counts)
    loss_fn = ClippedSurrogate(clip_low=0.2, clip_high=0.28)
    batch = two_rows()
    loss, stats = loss_fn(batch, BatchCounts(sequences=2, tokens=3, max_new_tokens=2))
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 0.8) / 3)
    assert {k: v.item() for k, v in stats.items()} == {
        "clip/low": 1.0, "clip/high": 1.0, "kl": 0.0, "rollout/tis_weight_mean": 3.0,
    }  # fmt: skip
    loss.backward()
    # d loss / d logp: only the unclipped token, -A rho / 3 = -1/3; padding gets nothing
    torch.testing.assert_close(batch.logp.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))
    # the same rows as half of a 6-token mini-batch split over micro-batches or processes: half the loss
    half, _ = loss_fn(two_rows(), BatchCounts(sequences=4, tokens=6, max_new_tokens=2))
    assert half.item() == pytest.approx(loss.item() / 2)


def test_a_sampler_log_prob_of_minus_inf_leaves_the_loss_and_gradient_finite():
    """With ``bypass`` the sampler's log-probs are the ratio's denominator: one of -inf, or 93 below the trainer's,
    made rho inf in float32 (A > 0: a NaN gradient; A < 0: an infinite loss), and the step was skipped on every
    process (found by a review). The log-ratio is clamped at 20 as the importance weights' is: A = +1 clips there
    (gradient 0), A = -1 gives -(e^20 x -1) = e^20, finite; the other tokens' values are unchanged."""
    from sgrpo.train.loss import clipped_surrogate

    for bad in (-math.inf, -95.0):
        logp = torch.full((2, 2), -2.0, requires_grad=True)
        old = torch.tensor([[-2.0, bad], [-2.0, bad]])
        loss, _, high = clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), 0.2, 0.28)
        assert torch.isfinite(loss).all() and high[0, 1]
        assert loss[0, 0].item() == -1.0 and loss[1, 1].item() == pytest.approx(math.exp(20), rel=1e-6)
        loss.sum().backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[0, 1].item() == 0.0


def test_aggregations_kl_and_truncated_importance_sampling_by_hand():
    # seq_sum_const (Dr.GRPO): sum of token losses / (B x L_max) = (-1.28 - 1 + 0.8) / (2 x 4)
    dr = ClippedSurrogate(clip_low=0.2, clip_high=0.28, aggregation="seq_sum_const")
    assert dr(two_rows(), BatchCounts(2, 3, 4))[0].item() == pytest.approx(-1.48 / 8)
    # seq_mean_token_mean: mean over rows of each row's token mean: ((-1.28 - 1) / 2 + 0.8) / 2
    grpo = ClippedSurrogate(clip_low=0.2, clip_high=0.28, aggregation="seq_mean_token_mean")
    assert grpo(two_rows(), BatchCounts(2, 3, 4))[0].item() == pytest.approx((-1.14 + 0.8) / 2)
    # KL: k3 with d = ref - logp = [-0.5, 0, 0.5]: e^d - d - 1 = [0.10653, 0, 0.14872], x kl_coef 0.1 per token
    ref = torch.zeros(2, 2)
    with_kl = ClippedSurrogate(clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    loss, stats = with_kl(two_rows(ref_logp=ref), BatchCounts(2, 3, 2))
    k3 = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(0.5) - 0.5 - 1]
    assert stats["kl"].item() == pytest.approx(sum(k3))
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 0.8 + 0.1 * sum(k3)) / 3)
    assert with_kl.needs_reference and not with_kl.zero_at_zero_advantage
    # TIS: an external sampler with log-probs [-1, 0, 0] under old 0: weights min(e^{0 - s}, 2) = [2, 1, 1]
    sampler = torch.tensor([[-1.0, 0.0], [0.0, 0.0]])
    tis = ClippedSurrogate(clip_low=0.2, clip_high=0.28, importance_sampling_cap=2.0)
    loss, stats = tis(two_rows(sampler_logp=sampler), BatchCounts(2, 3, 2))
    assert loss.item() == pytest.approx((-1.28 * 2 - 1.0 + 0.8) / 3) and stats["rollout/tis_weight_mean"].item() == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.0}, "clip_low < 1"),
        ({"aggregation": "sum"}, "aggregation must be one of"),
        ({"kl_coef": -0.1}, "kl_coef must be >= 0"),
        ({"importance_sampling_cap": 0.0}, "importance_sampling_cap must be > 0"),
    ],
)
def test_clipped_surrogate_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClippedSurrogate(**kwargs)


class SequenceRatio(PolicyLoss):
    """A user's loss (GSPO-style): one ratio per sequence, exp(mean over its tokens of logp - old), clipped."""

    stats = ("clip/any",)

    def __init__(self, clip: float = 0.1) -> None:
        self.clip = clip

    def __call__(self, batch: TokenBatch, counts: BatchCounts):
        m = batch.mask.float()
        log_ratio = ((batch.logp - batch.old_logp) * m).sum(-1) / m.sum(-1).clamp_min(1)  # [n]
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
        per_seq = -torch.minimum(ratio * batch.advantages, clipped * batch.advantages)
        return per_seq.sum() / counts.sequences, {"clip/any": ((clipped != ratio).float()[:, None] * m).sum()}


def test_a_loss_class_chosen_in_the_config_trains(tmp_path):
    """``--model.loss`` takes any PolicyLoss by import path; its statistics are logged as train/<name>."""
    cli = main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2", "--trainer.val_check_interval=100", "--trainer.enable_progress_bar=false",
        "--model.loss=tests.test_policy_loss.SequenceRatio", "--model.loss.clip=0.05",
    ])  # fmt: skip
    assert isinstance(cli.model.loss, SequenceRatio) and cli.model.loss.clip == 0.05
    metrics = cli.trainer.callback_metrics
    assert "train/clip/any" in metrics and "train/clip/low" not in metrics
    assert cli.trainer.global_step == 2


def test_micro_batch_token_mean_is_verls_token_mean_per_micro_batch_by_hand():
    # verl 0.6.1's token-mean: each micro-batch of ppo_micro_batch_size_per_gpu rows (2 here) its own token mean,
    # x 1 / accumulation steps, averaged over ranks. Rows: 3, 1 | 2, 4 tokens; per-token loss -A (ratio 1) with
    # A = [1, 2 | 3, 4]: micro-batch 1: (3 x -1 + 1 x -2) / 4 = -1.25; micro-batch 2: (2 x -3 + 4 x -4) / 6 = -22/6;
    # the loss is their mean (-1.25 - 22/6) / 2 = -2.4583; a global token mean would give -24/10 = -2.4
    lengths, adv = [3, 1, 2, 4], torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.arange(4).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)  # [4, 4]
    logp = torch.zeros(4, 4, requires_grad=True)
    group_tokens, groups = loss_groups(mask.sum(-1), 2)
    assert group_tokens.tolist() == [4.0, 4.0, 6.0, 6.0] and groups == 2
    loss_fn = ClippedSurrogate(aggregation="micro_batch_token_mean", micro_batch_rows=2)
    counts = BatchCounts(sequences=4, tokens=10, max_new_tokens=4, groups=groups)
    whole = TokenBatch(logp, torch.zeros(4, 4), adv, mask, group_tokens=group_tokens)
    loss, _ = loss_fn(whole, counts)
    assert loss.item() == pytest.approx((-1.25 - 22 / 6) / 2)
    loss.backward()
    # d loss / d logp of a token: -A / (tokens of its micro-batch x micro-batches)
    want = torch.tensor([-1 / 8, -1 / 8, -1 / 8, 0] + [-2 / 8, 0, 0, 0] + [-3 / 12] * 2 + [0, 0] + [-4 / 12] * 4)
    torch.testing.assert_close(logp.grad, want.view(4, 4) * mask)
    # the memory micro-batches cut elsewhere (rows 0 | 1, 2, 3): the shares add up to the same loss
    parts = [
        loss_fn(TokenBatch(logp[r], torch.zeros(len(r), 4), adv[r], mask[r], group_tokens=group_tokens[r]), counts)[0]
        for r in (torch.tensor([0]), torch.tensor([1, 2, 3]))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())
    # two processes of 2 rows each (one loss micro-batch each): each one's counts summed over both, shares added
    shares = []
    for r in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        tokens, n = loss_groups(mask[r].sum(-1), 2)
        share, _ = loss_fn(TokenBatch(logp[r], torch.zeros(2, 4), adv[r], mask[r], group_tokens=tokens), counts)
        shares.append(share.item())
        assert n == 1
    assert sum(shares) == pytest.approx(loss.item())
    # a short last group: 3 rows in groups of 2 -> groups [0, 1], [2]
    tokens, n = loss_groups(torch.tensor([1, 2, 5]), 2)
    assert tokens.tolist() == [3.0, 3.0, 5.0] and n == 2


def test_k3_value_clamp_as_verls_low_var_kl():
    # d = ref - logp = [3, 0.5]: e^3 - 3 - 1 = 16.0855 -> clamped to 10 (its gradient stops); e^0.5 - 1.5 = 0.14872
    logp = torch.tensor([[-3.0, -0.5]], requires_grad=True)
    kl = k3_kl(logp, torch.zeros(1, 2), max_value=10.0)
    assert kl.tolist()[0] == pytest.approx([10.0, math.exp(0.5) - 1.5])
    kl.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -(math.exp(0.5) - 1)])
    assert k3_kl(torch.tensor([-3.0]), torch.zeros(1)).item() == pytest.approx(math.exp(3) - 4)  # unclamped by default
    loss_fn = ClippedSurrogate(kl_coef=0.1, kl_max=10.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    batch = TokenBatch(logp.detach(), logp.detach(), torch.zeros(1), mask, torch.zeros(1, 2))
    _, stats = loss_fn(batch, BatchCounts(1, 2, 2))
    assert stats["kl"].item() == pytest.approx(10.0 + math.exp(0.5) - 1.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggregation": "micro_batch_token_mean"}, "micro_batch_rows (an int >= 1) goes with"),
        ({"micro_batch_rows": 4}, "micro_batch_rows (an int >= 1) goes with"),
        ({"aggregation": "micro_batch_token_mean", "micro_batch_rows": 0}, "micro_batch_rows (an int >= 1)"),
        ({"kl_max": 0.0}, "kl_max must be > 0"),
    ],
)
def test_micro_batch_rows_and_kl_max_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClippedSurrogate(**kwargs)
