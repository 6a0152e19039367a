"""Importance corrections of the decoupled objective: the weight ``proximal / behaviour`` and what bounds it.

A stale row (sampled at weights older than the update's, by an asynchronous producer) or an external sampler's
row (vLLM: its own kernels) was drawn from a *behaviour* policy mu, not from the *proximal* policy pi_prox whose
log-probs the update recomputes at the weights it starts from. The decoupled PPO objective (Hilton et al. 2021,
"Batch size-invariance for policy optimization", arXiv 2110.00641; AReaL, arXiv 2505.24298) clips the ratio
pi_theta / pi_prox as PPO does and multiplies each token by the importance weight

    w_t = pi_prox(o_t) / mu(o_t) = exp(delta_t),   delta_t = log pi_prox(o_t) - log mu(o_t),

a constant (no gradient). Its variance grows with the gap between the two policies, so users bound it with
``ImportanceCorrection`` classes, applied in the order given and composable: ``TokenTruncation`` (truncated
importance sampling, TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"), ``TokenMask``, ``SequenceMask``, ``GeometricMeanMask`` and ``K3Rejection`` (verl's rollout correction:
rejection sampling of tokens and sequences; Liu, Li et al. 2025, "When speed kills stability"). A masked token
keeps its place in the aggregation's denominator with weight 0 (verl and AReaL drop it from the denominator too),
so the loss scale does not move with the masked fraction. docs/policy_loss.md §7.7 states the formulas.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: |delta| is clamped here before exp (a raw weight e^20 is already meaningless, and exp must stay finite)
MAX_LOG_RATIO = 20.0
#: token-summed statistics a loss returns for ``offpolicy_metrics`` (``PolicyLoss.offpolicy_stats``)
OFFPOLICY_STATS = (
    "offpolicy/tokens", "offpolicy/kept", "offpolicy/weight", "offpolicy/weight_sq", "offpolicy/k3",
    "offpolicy/truncated", "offpolicy/sequences", "offpolicy/masked_sequences",
)  # fmt: skip


class ImportanceCorrection(ABC):
    """One bound on the importance weights: ``(weight, keep) -> (weight, keep)``, all ``[n, T]``.

    ``log_ratio`` ``[n, T]`` is delta = log pi_prox - log mu (clamped to +-``MAX_LOG_RATIO``), ``mask`` the loss
    tokens (bool), ``weight`` the weights so far (float32) and ``keep`` the tokens kept so far (bool). A
    truncation lowers ``weight``; a mask clears ``keep`` (the token's weight becomes 0). Sequence statistics are
    taken over the sequence's loss tokens, whatever earlier corrections did (``SequenceCorrection``).
    """

    @abstractmethod
    def __call__(self, log_ratio: Tensor, mask: Tensor, weight: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """The corrected ``(weight, keep)``."""


def _band(low: float, high: float, name: str) -> None:
    if not 0 <= low < high:
        raise ValueError(f"{name} needs 0 <= low < high, got low {low}, high {high}")


def log_ratios(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """``[n, T]`` float32: delta = log pi_prox - log mu (detached, clamped to +-``MAX_LOG_RATIO``), 0 off the loss
    tokens ``mask``."""
    delta = (proximal.detach().float() - behaviour.detach().float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))


def sequence_sums(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """``[n, 3]`` float32, each row's statistics over its loss tokens ``mask``: ``sum_t delta_t``, ``sum_t k3_t``
    and its token count |o_i| (what a ``SequenceCorrection`` decides by)."""
    m = mask.bool()
    return torch.stack([(log_ratio * m).sum(-1), (k3(log_ratio) * m).sum(-1), m.sum(-1).float()], dim=-1)


class SequenceCorrection(ImportanceCorrection):
    """A rejection of whole sequences by their ``sequence_sums``: a row's own, or, given ``sequences`` ``[n, 3]``,
    those of each row's multi-turn trajectory over all its rows (``sgrpo.train.sequences.trajectory_sums``), so
    that a trajectory that continued in a new row is kept or dropped whole, as the sequence it is."""

    def __call__(self, log_ratio: Tensor, mask: Tensor, weight: Tensor, keep: Tensor,
                 sequences: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        stats = sequence_sums(log_ratio, mask) if sequences is None else sequences.float()
        total, k3_total, tokens = (column.unsqueeze(-1) for column in stats.unbind(-1))  # [n, 1] each
        return weight, keep & self.keeps(total, k3_total, tokens)

    @abstractmethod
    def keeps(self, total: Tensor, k3_total: Tensor, tokens: Tensor) -> Tensor:
        """``[n, 1]`` bool: the sequences kept, from their sum of delta, sum of k3 and loss tokens (``[n, 1]`` each)."""


class TokenTruncation(ImportanceCorrection):
    """Truncated importance sampling (TIS; Yao et al. 2025; verl ``rollout_is: token``): ``w_t <- min(w_t, cap)``.

    Bias for bounded variance: a token the behaviour policy under-sampled counts at most ``cap`` times.
    ``ClippedSurrogate``'s ``importance_sampling_cap: C`` is ``TokenTruncation(C)``.

    Args:
        cap: The largest weight (> 0).
    """

    def __init__(self, cap: float = 2.0) -> None:
        if not cap > 0:
            raise ValueError(f"TokenTruncation cap must be > 0, got {cap}")
        self.cap = cap

    def __call__(self, log_ratio: Tensor, mask: Tensor, weight: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        return weight.clamp(max=self.cap), keep


class TokenMask(ImportanceCorrection):
    """Token rejection (verl ``rollout_rs: token``; AReaL's ``behav_imp_weight_cap`` is ``low = 0``): drop token t
    unless ``low <= w_t <= high``, that is ``log low <= delta_t <= log high``.

    Args:
        low: Smallest kept weight (>= 0; 0 keeps every small weight).
        high: Largest kept weight (> low).
    """

    def __init__(self, low: float = 0.5, high: float = 2.0) -> None:
        _band(low, high, "TokenMask")
        self.low, self.high = low, high

    def __call__(self, log_ratio: Tensor, mask: Tensor, weight: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        lo = -math.inf if self.low == 0 else math.log(self.low)
        return weight, keep & (log_ratio >= lo) & (log_ratio <= math.log(self.high))


class SequenceMask(SequenceCorrection):
    """Sequence rejection by the sequence's importance ratio (verl ``rollout_rs: sequence``): drop sequence i (a row, or
    a forked trajectory's rows: ``SequenceCorrection``) unless ``low <= prod_t w_t <= high``, that is
    ``log low <= sum_t delta_t <= log high`` over its loss tokens.

    Args:
        low: Smallest kept sequence ratio (>= 0).
        high: Largest kept sequence ratio (> low).
    """

    def __init__(self, low: float = 0.5, high: float = 2.0) -> None:
        _band(low, high, "SequenceMask")
        self.low, self.high = low, high

    def keeps(self, total: Tensor, k3_total: Tensor, tokens: Tensor) -> Tensor:
        lo = -math.inf if self.low == 0 else math.log(self.low)
        return (total >= lo) & (total <= math.log(self.high))


class GeometricMeanMask(SequenceCorrection):
    """Sequence rejection by the geometric mean of its weights (verl ``rollout_rs: geometric``; Liu, Li et al.
    2025): drop sequence i (a row, or a forked trajectory's rows) unless ``low <= exp(mean_t delta_t) <= high`` over
    its |o_i| loss tokens. Unlike ``SequenceMask`` the band does not tighten with length, so long completions are not
    rejected for their length.

    Args:
        low: Smallest kept geometric-mean weight (>= 0).
        high: Largest kept geometric-mean weight (> low).
    """

    def __init__(self, low: float = 0.99, high: float = 1.01) -> None:
        _band(low, high, "GeometricMeanMask")
        self.low, self.high = low, high

    def keeps(self, total: Tensor, k3_total: Tensor, tokens: Tensor) -> Tensor:
        mean = total / tokens.clamp_min(1)
        lo = -math.inf if self.low == 0 else math.log(self.low)
        return (mean >= lo) & (mean <= math.log(self.high))


class K3Rejection(SequenceCorrection):
    """Sequence rejection by divergence (verl's k3 rejection): drop sequence i when the mean over its loss tokens of the
    k3 estimate of KL(mu || pi_prox), ``k3_t = w_t - 1 - delta_t`` (>= 0; Schulman's k3 with samples from mu),
    exceeds ``threshold``.

    Args:
        threshold: Largest kept per-token mean k3 (> 0).
    """

    def __init__(self, threshold: float = 0.01) -> None:
        if not threshold > 0:
            raise ValueError(f"K3Rejection threshold must be > 0, got {threshold}")
        self.threshold = threshold

    def keeps(self, total: Tensor, k3_total: Tensor, tokens: Tensor) -> Tensor:
        return k3_total / tokens.clamp_min(1) <= self.threshold


def k3(log_ratio: Tensor) -> Tensor:
    """``exp(delta) - 1 - delta`` per token: the k3 estimate of KL(mu || pi_prox) for tokens drawn from mu."""
    return torch.expm1(log_ratio) - log_ratio


@dataclass(frozen=True)
class ImportanceWeights:
    """What ``importance_weights`` gives: the weights the loss multiplies in and the statistics of how it got them."""

    weight: Tensor  # [n, T] float32, no gradient: 0 off the loss tokens and on masked ones
    keep: Tensor  # [n, T] bool: loss tokens no correction masked
    truncated: Tensor  # [n, T] bool: kept tokens whose weight a truncation lowered
    log_ratio: Tensor  # [n, T] float32: delta = log pi_prox - log mu (clamped), 0 off the loss tokens

    def stats(self, mask: Tensor) -> dict[str, Tensor]:
        """``OFFPOLICY_STATS``: sums over the loss tokens ``mask`` (and its rows with any) that add up over
        micro-batches and processes (``offpolicy_metrics`` turns them into means)."""
        m, kept, rows = mask.bool(), self.keep.float(), mask.bool().any(-1)
        return {
            "offpolicy/tokens": m.sum().float(),
            "offpolicy/kept": kept.sum(),
            "offpolicy/weight": (self.weight * kept).sum(),
            "offpolicy/weight_sq": (self.weight.square() * kept).sum(),
            "offpolicy/k3": (k3(self.log_ratio) * m).sum(),
            "offpolicy/truncated": self.truncated.float().sum(),
            "offpolicy/sequences": rows.sum().float(),
            "offpolicy/masked_sequences": (rows & ~(self.keep.any(-1))).sum().float(),
        }


def importance_weights(
    proximal: Tensor, behaviour: Tensor, mask: Tensor, corrections: Sequence[ImportanceCorrection] = (),
    sequences: Tensor | None = None,
) -> ImportanceWeights:
    """The decoupled objective's weights ``w_t = exp(log pi_prox - log mu)`` with ``corrections`` applied in order.

    ``proximal``/``behaviour`` ``[n, T]`` log-probs (detached, computed in float32), ``mask`` ``[n, T]`` the loss
    tokens. Without corrections the weight is the raw ratio (delta clamped to +-``MAX_LOG_RATIO``). ``sequences``
    ``[n, 3]``: each row's trajectory's ``sequence_sums``, for the ``SequenceCorrection`` ones (None: each row's own).
    """
    if proximal.shape != behaviour.shape or mask.shape != behaviour.shape:
        raise ValueError(f"shapes differ: {tuple(proximal.shape)}, {tuple(behaviour.shape)}, {tuple(mask.shape)}")
    m = mask.bool()
    delta = log_ratios(proximal, behaviour, m)
    raw = delta.exp()
    weight, keep = raw, m
    for correction in corrections:
        if isinstance(correction, SequenceCorrection):
            weight, keep = correction(delta, m, weight, keep, sequences)
        else:
            weight, keep = correction(delta, m, weight, keep)
    keep = keep & m
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    return ImportanceWeights(weight, keep, keep & (weight < raw), delta)


def offpolicy_metrics(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """``train/offpolicy/*`` from ``OFFPOLICY_STATS`` sums already reduced over processes:

    * ``ess``: normalised effective sample size of the applied token weights over the kept tokens,
      ``(sum w)^2 / (n sum w^2)`` in (0, 1] (1: all weights equal; Kong 1992), 1 when none was kept;
    * ``k3``: mean over the loss tokens of ``w - 1 - log w``, KL(behaviour || proximal) per token;
    * ``masked_fraction`` (tokens), ``masked_sequence_fraction`` (rows with no token left),
      ``truncated_fraction`` (tokens whose weight a truncation clipped), ``weight_mean`` (over kept tokens).
    """
    tokens = sums["offpolicy/tokens"].clamp_min(1.0)
    kept, w, w2 = sums["offpolicy/kept"], sums["offpolicy/weight"], sums["offpolicy/weight_sq"]
    ess = torch.where(w2 > 0, w.square() / (kept * w2).clamp_min(1e-30), torch.ones_like(w))
    return {
        "train/offpolicy/ess": ess,
        "train/offpolicy/k3": sums["offpolicy/k3"] / tokens,
        "train/offpolicy/masked_fraction": (sums["offpolicy/tokens"] - kept) / tokens,
        "train/offpolicy/masked_sequence_fraction": sums["offpolicy/masked_sequences"]
        / sums["offpolicy/sequences"].clamp_min(1.0),
        "train/offpolicy/truncated_fraction": sums["offpolicy/truncated"] / tokens,
        "train/offpolicy/weight_mean": w / kept.clamp_min(1.0),
    }
