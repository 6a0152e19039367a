"""The policy loss as a component: per-token maths, and ``PolicyLoss`` classes chosen in a config.

A ``PolicyLoss`` turns one micro-batch's log-probs and advantages (``TokenBatch``) into its share of the
mini-batch loss, given the counts of the whole mini-batch over all processes (``BatchCounts``), so that
the pieces add up to the same loss however the batch is split. ``ClippedSurrogate`` is GRPO's / DAPO's
PPO-clip objective with a k3 KL term and truncated importance sampling; a user adds a loss (sequence-level
ratios as in GSPO, CISPO's clipped weights) as one more class. Formulas: docs/policy_loss.md §7 (GRPO arXiv
2402.03300, DAPO arXiv 2503.14476, Dr.GRPO arXiv 2503.20783). Nothing here knows about trainers or configs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from sgrpo.train.correction import (
    MAX_LOG_RATIO,
    OFFPOLICY_STATS,
    ImportanceCorrection,
    ImportanceWeights,
    TokenTruncation,
    importance_weights,
)

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_sum_const", "micro_batch_token_mean"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_sum_const", "micro_batch_token_mean")


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip per token: ``-min(rho A, clip(rho, 1-clip_low, 1+clip_high) A)``, rho = exp(logp - old).

    ``logp``/``old_logp`` ``[N, T]``, ``advantages`` ``[N]`` (broadcast over tokens). Returns the loss
    ``[N, T]`` and where the clip was active below / above (bool ``[N, T]``). DAPO's clip-higher is
    ``clip_high > clip_low``. The log-ratio is clamped to +-``MAX_LOG_RATIO`` (20) before ``exp``, as the importance
    weights' is (``sgrpo.train.correction``): with ``bypass`` the sampler's log-probs are ``old``, and one of -inf
    or some 88 below the trainer's (a sampler's bad value) made rho inf in float32, so the step's loss or gradient
    was not finite and the whole step was skipped; within the clamp nothing changes.
    """
    ratio = torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    adv = advantages.unsqueeze(-1).to(logp.dtype)  # [N, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    active = clipped < unclipped
    return loss, active & (ratio < 1 - clip_low), active & (ratio > 1 + clip_high)


def k3_kl(logp: Tensor, ref_logp: Tensor, max_log_ratio: float = 20.0, max_value: float | None = None) -> Tensor:
    """k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp`` clamped to
    [-max_log_ratio, max_log_ratio] (the value is >= 0); with ``max_value``, the value is then clamped to
    [-max_value, max_value] (verl's low_var_kl: 10), which stops the gradient of a token past it."""
    d = (ref_logp - logp).clamp(-max_log_ratio, max_log_ratio)
    kl = torch.expm1(d) - d
    return kl if max_value is None else kl.clamp(-max_value, max_value)


def token_weights(
    mask: Tensor,
    mode: Aggregation,
    num_sequences: float,
    num_tokens: float,
    max_new_tokens: int,
    group_tokens: Tensor | None = None,
    num_groups: float = 0.0,
    sequence_tokens: Tensor | None = None,
) -> Tensor:
    """Per-token weights ``[N, T]`` such that ``loss = sum(weights * per_token_loss)``.

    The counts are those of the *global* batch (all micro-batches and processes), so summing the
    pieces gives the same loss however the batch is split (docs/policy_loss.md §7):
      token_mean              1 / sum_i |o_i|                 (DAPO)
      seq_mean_token_mean     1 / (B |o_i|)                   (original GRPO)
      seq_sum_const           1 / (B L_max)                   (Dr.GRPO; L_max = max_new_tokens)
      micro_batch_token_mean  1 / (M |g(i)|)                  (verl 0.6.1's token-mean)
    where for micro_batch_token_mean the rows are cut into M groups of a fixed number of rows over all
    processes (``loss_groups``), g(i) is row i's group and |g(i)| its tokens (``group_tokens`` ``[N]``,
    ``num_groups`` = M): the mean over groups of each group's token mean, as verl's ``token-mean`` over
    ``ppo_micro_batch_size_per_gpu`` rows, scaled by 1 / accumulation steps and averaged over ranks.
    A sequence i is a trajectory: B counts trajectories and |o_i| is ``sequence_tokens`` ``[N]`` (its loss tokens
    over all its rows) where given, else the row's own (single-turn); ``sgrpo.train.sequences``.
    """
    m = mask.float()
    if mode == "micro_batch_token_mean":
        if group_tokens is None or num_groups <= 0:
            raise ValueError("micro_batch_token_mean needs each row's group tokens and the number of groups")
        return m / (group_tokens.float().clamp_min(1.0).unsqueeze(-1) * num_groups)
    if mode == "token_mean":
        return m / max(num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        lengths = m.sum(-1) if sequence_tokens is None else sequence_tokens.to(m)  # [N]
        return m / (lengths.unsqueeze(-1).clamp_min(1.0) * max(num_sequences, 1.0))
    if mode == "seq_sum_const":
        return m / (max(num_sequences, 1.0) * max_new_tokens)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def tis_weights(trainer_logp: Tensor, vllm_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(logp_trainer - logp_vllm), cap)``, ``[N, T]`` float32.

    ``trainer_logp``: the trainer's log-probs of the sampled tokens at the weights that sampled them
    (the "old" log-probs); ``vllm_logp``: the engine's. The weights correct the surrogate for the
    engine's numerics differing from the trainer's; they carry no gradient and are 0 off ``mask``.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if trainer_logp.shape != vllm_logp.shape or mask.shape != vllm_logp.shape:
        raise ValueError(f"shapes differ: {tuple(trainer_logp.shape)}, {tuple(vllm_logp.shape)}, {tuple(mask.shape)}")
    log_ratio = (trainer_logp.detach().float() - vllm_logp.detach().float()).clamp(max=math.log(cap))
    return torch.where(mask.bool(), log_ratio.exp(), torch.zeros_like(log_ratio))


def loss_groups(token_counts: Tensor, rows_per_group: int) -> tuple[Tensor, int]:
    """Consecutive groups of ``rows_per_group`` rows (the last may be short), as verl's micro-batches of
    ``ppo_micro_batch_size_per_gpu`` rows: each row's group's token count ``[N]`` and the number of groups.

    ``token_counts`` ``[N]``: the loss tokens of each row, in the order the rows are grouped.
    """
    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows_per_group}")
    n = token_counts.shape[0]
    group = torch.arange(n, device=token_counts.device) // rows_per_group  # [N]
    groups = -(-n // rows_per_group)
    sums = torch.zeros(groups, dtype=torch.float32, device=token_counts.device)
    sums.index_add_(0, group, token_counts.float())
    return sums[group], groups


@dataclass(frozen=True)
class TokenBatch:
    """One micro-batch of completion tokens, ``[n, T]`` over its n rows (T trimmed to its longest row)."""

    logp: Tensor  # [n, T] the current policy's log-probs, with gradient
    old_logp: Tensor  # [n, T] the PPO anchor: at the weights the update starts from (the proximal policy; logp
    # detached on a single on-policy pass), or the sampler's own in ClippedSurrogate's bypass mode
    advantages: Tensor  # [n]
    mask: Tensor  # [n, T] bool: the tokens that carry loss
    ref_logp: Tensor | None = None  # [n, T] the frozen KL reference's, when the loss asks for one
    sampler_logp: Tensor | None = None  # [n, T] the behaviour policy's (vLLM's, a stale producer's): importance weights
    group_tokens: Tensor | None = None  # [n] the tokens of each row's loss group (``PolicyLoss.rows_per_group``)
    sequence_tokens: Tensor | None = None  # [n] the loss tokens of each row's trajectory over all its rows (None:
    # the row's own; a multi-turn trajectory's rows are one sequence: sgrpo.train.sequences)
    sequence_sums: Tensor | None = None  # [n, 3] each row's trajectory's sum of delta, of k3 and its loss tokens,
    # for a SequenceCorrection (None: the row's own; sgrpo.train.sequences.trajectory_sums)


@dataclass(frozen=True)
class BatchCounts:
    """The whole mini-batch over all processes: the denominators of every aggregation."""

    sequences: float
    tokens: float
    max_new_tokens: int  # L_max of a constant-length aggregation
    groups: float = 0.0  # loss groups over all processes (``PolicyLoss.rows_per_group``; else 0)


class PolicyLoss(ABC):
    """A policy loss: ``__call__`` gives one micro-batch's share of the mini-batch loss and token-summed stats.

    The shares of all micro-batches and processes add up to the mini-batch loss (use ``BatchCounts``
    for every denominator). ``stats`` names the statistics it returns, each a sum over the batch's
    masked tokens; the policy logs ``train/<name>`` as their mean per token. ``needs_reference`` loads
    a frozen copy of the initial policy whose log-probs arrive as ``TokenBatch.ref_logp``.
    ``offpolicy_stats`` names more such sums, returned when ``TokenBatch.sampler_logp`` is given, that the update
    adds over processes and turns into ``train/offpolicy/*`` (``sgrpo.train.correction.offpolicy_metrics``).
    ``zero_at_zero_advantage`` promises that a row with advantage exactly 0 adds exactly 0 to the loss
    and its gradient, so the update need not run it. ``rows_per_group`` (an int) asks the update to cut
    each process's rows of a mini-batch, in order, into groups of that many rows (``loss_groups``),
    whatever its memory micro-batches, and to pass each row's group token count
    (``TokenBatch.group_tokens``) and the number of groups over all processes (``BatchCounts.groups``).
    """

    stats: tuple[str, ...] = ()
    needs_reference: bool = False
    zero_at_zero_advantage: bool = True
    rows_per_group: int | None = None
    weighs_sampler: bool = True  # reads TokenBatch.sampler_logp (importance weights): the update then runs a
    # forward at the sampling weights for old_logp; False: an external sampler's log-probs only feed metrics
    # (a stale batch's behaviour log-probs always reach the loss: sgrpo.train.update)
    bypass: bool = False  # a stale or external batch's sampler log-probs are the PPO anchor (old_logp): no forward
    offpolicy_stats: tuple[str, ...] = ()  # token sums for train/offpolicy/* (sgrpo.train.correction.OFFPOLICY_STATS)

    @abstractmethod
    def __call__(self, batch: TokenBatch, counts: BatchCounts) -> tuple[Tensor, dict[str, Tensor]]:
        """(scalar loss share, ``{name: sum over masked tokens}`` for every name in ``stats``)."""


class ClippedSurrogate(PolicyLoss):
    """PPO-clip surrogate with clip-higher, a k3 KL penalty and truncated importance sampling, aggregated.

    Per token, with ratio rho = exp(logp - old_logp) and the row's advantage A:
      l = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) x w + kl_coef x k3(logp, ref_logp)
    where w = 1 on an on-policy batch; when a behaviour policy mu sampled the tokens (an external sampler such
    as vLLM, or a stale producer: ``TokenBatch.sampler_logp``), old_logp is the proximal policy's (the weights
    the update starts from) and w = exp(old_logp - log mu), a constant, bounded by ``corrections`` (the
    decoupled PPO objective: Hilton et al. 2021, arXiv 2110.00641; AReaL, arXiv 2505.24298;
    ``sgrpo.train.correction``), by default ``TokenTruncation(importance_sampling_cap)``: min(w, C), truncated
    importance sampling. With ``bypass`` the sampler's log-probs are old_logp itself (rho = exp(logp - log mu),
    w = 1; no proximal forward). k3 is clamped to [-kl_max, kl_max] when ``kl_max`` is set.
    The loss is sum l x weight over tokens, the
    weights given by ``aggregation`` (``token_weights``: token_mean as DAPO, seq_mean_token_mean as the
    original GRPO, seq_sum_const as Dr.GRPO, micro_batch_token_mean as verl 0.6.1's token-mean over
    micro-batches of ``micro_batch_rows`` rows). Statistics: tokens clipped below / above, the k3 KL and
    the importance weight w, summed over the masked tokens.

    Args:
        clip_low: Ratio clipped below at 1 - clip_low (TRL ``epsilon``, verl ``clip_ratio_low``).
        clip_high: Ratio clipped above at 1 + clip_high (DAPO's clip-higher: 0.28).
        aggregation: token_mean (DAPO), seq_mean_token_mean (original GRPO) or seq_sum_const (Dr.GRPO).
        kl_coef: Weight of the k3 KL to the initial policy (0 loads no reference model).
        importance_sampling_cap: Cap of the truncated importance weight, ``TokenTruncation(cap)`` applied first
            (null: none; an external sampler's log-probs then only feed metrics, a stale batch gets the raw weight).
        micro_batch_rows: Rows per loss micro-batch of micro_batch_token_mean (verl's
            ``ppo_micro_batch_size_per_gpu``), per process, independent of ``micro_batch_size`` and
            ``micro_batch_tokens`` (the memory micro-batches).
        kl_max: Clamp of the k3 value to [-kl_max, kl_max] (verl's low_var_kl: 10; null: none).
        corrections: More ``sgrpo.train.correction.ImportanceCorrection`` classes (TokenMask, SequenceMask,
            GeometricMeanMask, K3Rejection, TokenTruncation when the cap is null), applied in order after the cap.
        bypass: Use the sampler's log-probs as the PPO anchor for stale or external batches (no proximal
            forward, no importance weight): the comparison baseline of the decoupled objective.
    """

    stats = ("clip/low", "clip/high", "kl", "rollout/tis_weight_mean")
    offpolicy_stats = OFFPOLICY_STATS

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: Aggregation = "token_mean",
        kl_coef: float = 0.0,
        importance_sampling_cap: float | None = 2.0,
        micro_batch_rows: int | None = None,
        kl_max: float | None = None,
        corrections: Sequence[ImportanceCorrection] = (),
        bypass: bool = False,
    ) -> None:
        if not (0 <= clip_low < 1 and clip_high >= 0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0 (0 loads no reference model), got {kl_coef}")
        if importance_sampling_cap is not None and not importance_sampling_cap > 0:
            raise ValueError(f"importance_sampling_cap must be > 0 or null, got {importance_sampling_cap}")
        self.clip_low, self.clip_high, self.aggregation = clip_low, clip_high, aggregation
        grouped = aggregation == "micro_batch_token_mean"
        if grouped != (micro_batch_rows is not None) or (grouped and micro_batch_rows < 1):
            raise ValueError(
                f"micro_batch_rows (an int >= 1) goes with aggregation micro_batch_token_mean and only with it, "
                f"got micro_batch_rows {micro_batch_rows} with aggregation {aggregation}"
            )
        if kl_max is not None and not kl_max > 0:
            raise ValueError(f"kl_max must be > 0 or null, got {kl_max}")
        self.kl_coef, self.importance_sampling_cap = kl_coef, importance_sampling_cap
        self.rows_per_group, self.kl_max = micro_batch_rows, kl_max
        corrections = tuple(corrections)
        if importance_sampling_cap is not None and any(isinstance(c, TokenTruncation) for c in corrections):
            raise ValueError("corrections has a TokenTruncation and importance_sampling_cap is set: give the cap once "
                             "(importance_sampling_cap: null with the TokenTruncation, or drop it from corrections)")
        if bypass and corrections:
            raise ValueError("bypass uses the sampler's log-probs as the PPO anchor, so there is no importance weight "
                             "to correct: drop corrections, or set bypass: false")
        cap = () if importance_sampling_cap is None else (TokenTruncation(importance_sampling_cap),)
        self.corrections, self.bypass = cap + corrections, bypass
        self.weighs_sampler = bool(self.corrections)
        self.needs_reference = kl_coef > 0
        self.zero_at_zero_advantage = kl_coef == 0  # the KL term has a gradient whatever the advantage

    def __call__(self, batch: TokenBatch, counts: BatchCounts) -> tuple[Tensor, dict[str, Tensor]]:
        per_token, low, high = clipped_surrogate(
            batch.logp, batch.old_logp, batch.advantages, self.clip_low, self.clip_high
        )
        m = batch.mask.float()
        stats = {"clip/low": (low.float() * m).sum(), "clip/high": (high.float() * m).sum(), "kl": m.new_zeros(())}
        stats["rollout/tis_weight_mean"] = m.sum()  # w = 1 on every token unless a behaviour policy's below
        if batch.sampler_logp is not None:
            weights = self.importance(batch)
            per_token = per_token * weights.weight
            stats["rollout/tis_weight_mean"] = weights.weight.sum()
            stats |= weights.stats(batch.mask)
        if batch.ref_logp is not None:
            kl = k3_kl(batch.logp, batch.ref_logp, max_value=self.kl_max)
            per_token = per_token + self.kl_coef * kl
            stats["kl"] = (kl.detach() * m).sum()
        weights = token_weights(
            batch.mask, self.aggregation, counts.sequences, counts.tokens, counts.max_new_tokens,
            batch.group_tokens, counts.groups, batch.sequence_tokens,
        )  # fmt: skip
        return (per_token * weights).sum(), stats

    def importance(self, batch: TokenBatch) -> ImportanceWeights:
        """The importance weights of ``batch`` (``sgrpo.train.correction.importance_weights``: proximal =
        ``old_logp``, behaviour = ``sampler_logp``, with ``corrections``)."""
        return importance_weights(batch.old_logp, batch.sampler_logp, batch.mask, self.corrections, batch.sequence_sums)
