"""The decoupled objective's importance corrections (sgrpo.train.correction) on crafted inputs, against values
computed by hand in float64 (docs/policy_loss.md §7.7)."""

from __future__ import annotations

import math

import pytest
import torch

from sgrpo.train.correction import (
    OFFPOLICY_STATS,
    GeometricMeanMask,
    K3Rejection,
    SequenceMask,
    TokenMask,
    TokenTruncation,
    importance_weights,
    offpolicy_metrics,
)
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, TokenBatch

# delta = log pi_prox - log mu per token; None: padding (off the loss mask)
DELTAS = [[0.1, -0.2, 1.0, None], [0.0, 0.05, None, None], [-1.5, 0.3, 0.2, 0.01]]
MASK = torch.tensor([[d is not None for d in row] for row in DELTAS])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.7, 0.0, 0.0], [-2.5, -0.1, -1.2, -0.4]])
PROXIMAL = BEHAVIOUR + torch.tensor([[d or 0.0 for d in row] for row in DELTAS])


def k3(d: float) -> float:
    return math.exp(d) - 1 - d


def want(keep_rows: list[list[bool]], cap: float = math.inf) -> torch.Tensor:
    """The hand weights: min(e^delta, cap) on kept loss tokens, 0 elsewhere (float64)."""
    return torch.tensor(
        [[min(math.exp(d), cap) if d is not None and k else 0.0 for d, k in zip(row, keep)]
         for row, keep in zip(DELTAS, keep_rows)], dtype=torch.float64,
    )  # fmt: skip


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)


ALL = [[True] * 4] * 3


def test_raw_weights_are_the_ratio_on_the_loss_tokens():
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK)
    close(w.weight, want(ALL))  # e.g. e^0.1 = 1.105171, e^-1.5 = 0.223130
    assert torch.equal(w.keep, MASK) and not w.truncated.any() and w.weight.dtype == torch.float32
    assert not importance_weights(PROXIMAL.clone().requires_grad_(), BEHAVIOUR, MASK).weight.requires_grad  # constant


def test_token_truncation_caps_each_weight():
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [TokenTruncation(2.0)])
    close(w.weight, want(ALL, cap=2.0))  # e^1.0 = 2.718 -> 2
    assert w.truncated.nonzero().tolist() == [[0, 2]] and torch.equal(w.keep, MASK)


def test_token_mask_drops_tokens_outside_the_band():
    # [log 0.5, log 2] = [-0.693, 0.693]: drops delta 1.0 (row 0) and -1.5 (row 2)
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [TokenMask(low=0.5, high=2.0)])
    keep = [[True, True, False, True], [True] * 4, [False, True, True, True]]
    close(w.weight, want(keep))
    assert (MASK & ~w.keep).nonzero().tolist() == [[0, 2], [2, 0]]
    # low 0 keeps every small weight: only the large one goes
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [TokenMask(low=0.0, high=2.0)])
    assert (MASK & ~w.keep).nonzero().tolist() == [[0, 2]]


def test_sequence_mask_uses_the_product_of_the_rows_weights():
    # sums of delta: 0.9 (e^0.9 = 2.46 > 2: drop), 0.05 (keep), -0.99 (e^-0.99 = 0.37 < 0.5: drop)
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [SequenceMask(low=0.5, high=2.0)])
    close(w.weight, want([[False] * 4, [True] * 4, [False] * 4]))
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [SequenceMask(low=0.3, high=2.5)])  # all inside
    close(w.weight, want(ALL))


def test_geometric_mean_mask_uses_the_mean_log_ratio():
    # means of delta over loss tokens: 0.3 (e^0.3 = 1.35), 0.025 (1.0253), -0.2475 (0.7807)
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [GeometricMeanMask(low=0.75, high=1.1)])
    close(w.weight, want([[False] * 4, [True] * 4, [True] * 4]))
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [GeometricMeanMask(low=0.79, high=1.4)])
    close(w.weight, want([[True] * 4, [True] * 4, [False] * 4]))


def test_k3_rejection_drops_rows_whose_mean_k3_exceeds_the_threshold():
    means = [sum(k3(d) for d in row if d is not None) / sum(d is not None for d in row) for row in DELTAS]
    assert means == pytest.approx([0.247395, 0.000635, 0.198611], abs=1e-6)  # by hand, e^d - 1 - d
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [K3Rejection(threshold=0.2)])
    close(w.weight, want([[False] * 4, [True] * 4, [True] * 4]))
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [K3Rejection(threshold=0.19)])
    close(w.weight, want([[False] * 4, [True] * 4, [False] * 4]))


def test_corrections_compose_and_their_statistics_by_hand():
    w = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [TokenTruncation(1.2), K3Rejection(threshold=0.2)])
    expected = want([[False] * 4, [True] * 4, [True] * 4], cap=1.2)  # e^0.3 = 1.35 and e^0.2 = 1.22 -> 1.2
    close(w.weight, expected)
    assert w.truncated.nonzero().tolist() == [[2, 1], [2, 2]]
    stats = w.stats(MASK)
    assert set(stats) == set(OFFPOLICY_STATS)
    kept = [math.exp(0.0), math.exp(0.05), math.exp(-1.5), 1.2, 1.2, math.exp(0.01)]
    k3_sum = sum(k3(d) for row in DELTAS for d in row if d is not None)
    by_hand = {
        "offpolicy/tokens": 9, "offpolicy/kept": 6, "offpolicy/weight": sum(kept),
        "offpolicy/weight_sq": sum(x * x for x in kept), "offpolicy/k3": k3_sum, "offpolicy/truncated": 2,
        "offpolicy/sequences": 3, "offpolicy/masked_sequences": 1,
    }  # fmt: skip
    assert {k: float(v) for k, v in stats.items()} == pytest.approx(by_hand, abs=1e-5)
    metrics = {k: float(v) for k, v in offpolicy_metrics(stats).items()}
    assert metrics == pytest.approx({
        "train/offpolicy/ess": sum(kept) ** 2 / (6 * sum(x * x for x in kept)),  # 0.857...
        "train/offpolicy/k3": k3_sum / 9,
        "train/offpolicy/masked_fraction": 3 / 9,
        "train/offpolicy/masked_sequence_fraction": 1 / 3,
        "train/offpolicy/truncated_fraction": 2 / 9,
        "train/offpolicy/weight_mean": sum(kept) / 6,
    }, abs=1e-6)  # fmt: skip
    assert 0 < metrics["train/offpolicy/ess"] < 1
    # equal weights: ESS 1; no kept token: ESS 1 and nothing divides by zero
    flat = importance_weights(BEHAVIOUR, BEHAVIOUR, MASK).stats(MASK)
    assert float(offpolicy_metrics(flat)["train/offpolicy/ess"]) == pytest.approx(1.0)
    none = importance_weights(PROXIMAL, BEHAVIOUR, MASK, [K3Rejection(1e-6)]).stats(MASK)
    assert all(math.isfinite(float(v)) for v in offpolicy_metrics(none).values())


def test_clipped_surrogate_multiplies_the_decoupled_weight_by_hand():
    # logp = proximal + [0.5 on row 2 token 1]: ratio vs the proximal e^0.5 = 1.649 there (A = +1: clipped at 1.2,
    # no gradient), 1 elsewhere; per token -min(rho A, clip(rho) A) x w; token_mean over the 9 loss tokens
    shift = torch.zeros(3, 4)
    shift[2, 1] = 0.5
    logp = (PROXIMAL + shift).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 1.0])
    batch = TokenBatch(logp=logp, old_logp=PROXIMAL, advantages=adv, mask=MASK, sampler_logp=BEHAVIOUR)
    loss_fn = ClippedSurrogate(importance_sampling_cap=None, corrections=[TokenMask(0.5, 2.0)])
    loss, stats = loss_fn(batch, BatchCounts(sequences=3, tokens=9, max_new_tokens=4))
    w = want([[True, True, False, True], [True] * 4, [False, True, True, True]])
    ratio = torch.ones(3, 4, dtype=torch.float64)
    ratio[2, 1] = 1.2
    by_hand = -(ratio * adv.double().unsqueeze(-1) * w).sum() / 9
    assert loss.item() == pytest.approx(float(by_hand), abs=1e-6)
    assert stats["offpolicy/kept"].item() == 7 and stats["rollout/tis_weight_mean"].item() == pytest.approx(
        float(w.sum()), abs=1e-5
    )
    loss.backward()
    grad = -(adv.double().unsqueeze(-1) * w) / 9  # d/dlogp of -rho A w = -rho A w at rho = 1
    grad[2, 1] = 0.0  # clipped
    close(logp.grad, grad)
    # the default is today's: TokenTruncation(2.0) first, and the paper configs' null cap has no correction
    assert [type(c) for c in ClippedSurrogate().corrections] == [TokenTruncation]
    assert ClippedSurrogate().corrections[0].cap == 2.0 and ClippedSurrogate().weighs_sampler
    off = ClippedSurrogate(importance_sampling_cap=None)
    assert off.corrections == () and not off.weighs_sampler and not off.bypass


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ClippedSurrogate(corrections=[TokenTruncation(3.0)]), "give the cap once"),
        (lambda: ClippedSurrogate(importance_sampling_cap=None, bypass=True, corrections=[TokenMask()]), "bypass"),
        (lambda: TokenTruncation(0.0), "cap must be > 0"),
        (lambda: TokenMask(low=2.0, high=1.0), "TokenMask needs 0 <= low < high"),
        (lambda: SequenceMask(low=-1.0), "SequenceMask needs"),
        (lambda: GeometricMeanMask(low=1.0, high=1.0), "GeometricMeanMask needs"),
        (lambda: K3Rejection(threshold=0.0), "threshold must be > 0"),
    ],
)
def test_bad_corrections_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# a forked episode: rows 0 and 1 are one trajectory (its rows' deltas), row 2 another
FORKED = [[0.3, 0.3], [-0.3, None], [0.3, 0.3]]
FORKED_MASK = torch.tensor([[d is not None for d in row] for row in FORKED])
FORKED_TRAJECTORY = torch.tensor([0, 0, 1])


@pytest.mark.parametrize("correction, per_row, per_trajectory", [
    # sums 0.6, -0.3, 0.6 all within [log 0.5, log 2]; trajectory 0's 0.3 too: kept alike (a control)
    (SequenceMask(0.5, 2.0), [True, True, True], [True, True, True]),
    # means 0.3, -0.3, 0.3 outside [log 0.9, log 1.2] = [-0.105, 0.182]; trajectory 0's (0.6 - 0.3) / 3 = 0.1 inside
    (GeometricMeanMask(0.9, 1.2), [False, False, False], [True, True, False]),
    # mean k3: e^0.3 - 1.3 = 0.04986 (rows 0, 2) > 0.045 >= e^-0.3 - 0.7 = 0.04082 (row 1); trajectory 0's
    # (2 x 0.04986 + 0.04082) / 3 = 0.04685 > 0.045: row 1 goes with its trajectory
    (K3Rejection(0.045), [False, True, False], [False, False, False]),
    # sums 0.6, -0.3, 0.6 outside [log 1, log 1.5] = [0, 0.405]; trajectory 0's 0.6 - 0.3 = 0.3 inside
    (SequenceMask(1.0, 1.5), [False, False, False], [True, True, False]),
])  # fmt: skip
def test_sequence_corrections_keep_or_reject_a_forked_trajectory_whole(correction, per_row, per_trajectory):
    """A multi-turn trajectory that continued in a new row is one sequence: its statistics are summed over all its
    rows (``sgrpo.train.sequences.trajectory_sums``), and its rows are kept or dropped together. Each row used to be
    judged alone. Sums computed by hand."""
    from sgrpo.train.sequences import trajectory_sums

    proximal = torch.tensor([[0.0 if d is None else d for d in row] for row in FORKED], dtype=torch.float64)
    behaviour = torch.zeros_like(proximal)
    sums = trajectory_sums(proximal, behaviour, FORKED_MASK, torch.arange(3), FORKED_TRAJECTORY)
    up, down = math.expm1(0.3) - 0.3, math.expm1(-0.3) + 0.3
    want = [[0.3, 2 * up + down, 3.0], [0.3, 2 * up + down, 3.0], [0.6, 2 * up, 2.0]]
    assert torch.allclose(sums, torch.tensor(want), rtol=0, atol=1e-6)
    assert trajectory_sums(proximal, behaviour, FORKED_MASK, torch.arange(3), None) is None  # single-turn: own rows

    def kept(sequences):
        keep = importance_weights(proximal, behaviour, FORKED_MASK, [correction], sequences).keep
        return (keep == FORKED_MASK).all(-1).tolist()  # each row kept whole (or dropped whole)

    assert [bool(k) and bool(FORKED_MASK[i].any()) for i, k in enumerate(kept(None))] == per_row
    assert kept(sums) == per_trajectory
