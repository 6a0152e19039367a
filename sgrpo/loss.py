"""Policy-loss maths as pure tensor functions: chunked log-probs, the clipped surrogate, k3 KL, aggregation.

Formulas follow spec/estimators.md §2.5-2.7 (GRPO arXiv 2402.03300, DAPO arXiv 2503.14476, Dr.GRPO
arXiv 2503.20783). Nothing here knows about trainers, configs or estimators.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_sum_const"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_sum_const")


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them: ``[N, S]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunk_mib: float = 128.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the completion tokens under ``model``, ``[N, T]`` each.

    ``input_ids``/``attention_mask`` ``[N, P+T]``, ``completion_mask`` ``[N, T]``. Logits are
    ``lm_head(h) / temperature`` (the sampling distribution before top-k/top-p). The LM head runs
    only on completion tokens, ``chunk_size`` tokens at a time (by default as many as fit fp32
    logits in ``chunk_mib`` MiB) under activation checkpointing, so neither the forward nor the
    backward ever holds ``[N, T, vocab]`` logits. Padding gets 0.
    """
    t = completion_mask.shape[1]
    hidden = final_hidden_states(model, input_ids[:, :-1], attention_mask[:, :-1])[:, -t:]  # [N, T, H]
    head = model.get_output_embeddings()
    mask = completion_mask.bool()
    if chunk_size is None:
        chunk_size = max(1, int(chunk_mib * 2**20) // (4 * head.weight.shape[0]))
    h = hidden[mask]  # [M, H]
    targets = input_ids[:, -t:][mask]  # [M]
    pieces = [
        checkpoint(
            _token_logprobs,
            head,
            h[i : i + chunk_size],
            targets[i : i + chunk_size],
            temperature,
            with_entropy,
            use_reentrant=False,
        )
        if torch.is_grad_enabled()
        else _token_logprobs(head, h[i : i + chunk_size], targets[i : i + chunk_size], temperature, with_entropy)
        for i in range(0, h.shape[0], chunk_size)
    ]
    logp = hidden.new_zeros(mask.shape, dtype=torch.float32)
    entropy = hidden.new_zeros(mask.shape, dtype=torch.float32) if with_entropy else None
    if pieces:
        logp = logp.masked_scatter(mask, torch.cat([p[0] for p in pieces]))
        if entropy is not None:
            entropy = entropy.masked_scatter(mask, torch.cat([p[1] for p in pieces]))
    return logp, entropy


def final_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The decoder's last hidden states ``[N, S, H]``, through the model's own forward.

    The root forward runs (so wrappers such as FSDP2 gather the root's parameters, and keep them
    gathered until backward) with logits for the last position only; a hook on the decoder hands
    back its output.
    """
    captured: list[Tensor] = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            logits_to_keep=1,
            use_cache=False,
        )
    finally:
        handle.remove()
    return captured[-1]


def _token_logprobs(
    head: nn.Module, h: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    logits = head(h).float() / temperature  # [C, V]: one chunk only
    lse = logits.logsumexp(-1)  # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, logp.new_zeros(())
    entropy = lse - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy.detach()


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip per token: ``-min(rho A, clip(rho, 1-clip_low, 1+clip_high) A)``, rho = exp(logp - old).

    ``logp``/``old_logp`` ``[N, T]``, ``advantages`` ``[N]`` (broadcast over tokens). Returns the loss
    ``[N, T]`` and where the clip was active below / above (bool ``[N, T]``). DAPO's clip-higher is
    ``clip_high > clip_low``.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1).to(logp.dtype)  # [N, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    active = clipped < unclipped
    return loss, active & (ratio < 1 - clip_low), active & (ratio > 1 + clip_high)


def k3_kl(logp: Tensor, ref_logp: Tensor, max_log_ratio: float = 20.0) -> Tensor:
    """k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp`` clamped (>= 0)."""
    d = (ref_logp - logp).clamp(-max_log_ratio, max_log_ratio)
    return torch.expm1(d) - d


def token_weights(
    mask: Tensor, mode: Aggregation, num_sequences: float, num_tokens: float, max_new_tokens: int
) -> Tensor:
    """Per-token weights ``[N, T]`` such that ``loss = sum(weights * per_token_loss)``.

    The counts are those of the *global* batch (all micro-batches and processes), so summing the
    pieces gives the same loss however the batch is split (spec §2.7):
      token_mean           1 / sum_i |o_i|                    (DAPO)
      seq_mean_token_mean  1 / (B |o_i|)                      (original GRPO)
      seq_sum_const        1 / (B L_max)                      (Dr.GRPO; L_max = max_new_tokens)
    """
    m = mask.float()
    if mode == "token_mean":
        return m / max(num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        return m / (m.sum(-1, keepdim=True).clamp_min(1.0) * max(num_sequences, 1.0))
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


def logprob_mismatch(trainer_logp: Tensor, vllm_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's log-probs are from the trainer's on the sampled tokens (means over ``mask``).

    ``kl``: k3 estimate of KL(vllm || trainer), ``exp(-d) - 1 + d`` with ``d = logp_vllm - logp_trainer``;
    ``abs_diff``: mean ``|d|``.
    """
    d = (vllm_logp.detach().float() - trainer_logp.detach().float())[mask.bool()]
    if d.numel() == 0:
        return {"kl": d.new_zeros(()), "abs_diff": d.new_zeros(())}
    return {"kl": (torch.expm1(-d) + d).mean(), "abs_diff": d.abs().mean()}
