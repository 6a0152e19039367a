"""The decoder's sampler: one token per row from float32 logits, its log-prob, and the mass a truncation kept
(argmax, or the exponential race over the full or the top-k/top-p-cut softmax), from torch's generator."""

from __future__ import annotations

import torch
from torch import Tensor

from sgrpo.model.head import logits_dtype


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, greedy: bool) -> tuple[Tensor, Tensor]:
    """One token per row from ``logits`` ``[R, V]`` and the kept mass ``[R]`` (``sample_with_logprobs``'s)."""
    tokens, _, mass = sample_with_logprobs(logits, temperature, top_k, top_p, greedy)
    return tokens, mass


def sample_with_logprobs(
    logits: Tensor, temperature: float, top_k: int, top_p: float, greedy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row from ``logits`` ``[R, V]``, its log-prob under the full ``p = softmax(logits / T)`` and the
    kept mass: ``p``'s mass on the tokens the sampler could draw (1: nothing cut), ``[R]`` each (mass float32).

    Sampling is argmax, or the exponential race (argmax of p_i / E_i with E_i ~ Exp(1)), which draws exactly
    from p (cut to top-k then top-p where asked: the nucleus is the smallest set of most probable tokens whose mass
    reaches ``top_p``, the top token always kept, drawn from renormalised), from the global torch generator.
    Untruncated, the log-prob is read from the probabilities the race used, ``log p[token]``: seven operations over
    ``[R, V]`` per token (the scaling, the softmax, the draws' allocation and draws, the race's division and argmax,
    the gather), where sampling, then the log-prob from the logits again (scaling and logsumexp), took nine; greedy
    and truncated sampling take ``z[token] - logsumexp(z)`` of the full softmax (what the loss computes).
    """
    z = logits.to(logits_dtype(logits.dtype)) / temperature  # [R, V]: a new tensor, the caller's logits stay
    ones = torch.ones(z.shape[0], dtype=torch.float32, device=z.device)
    if greedy:
        tokens = logits.argmax(-1)
        return tokens, z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1), ones
    if 0 < top_k < z.shape[-1] or top_p < 1.0:
        kept = _truncated(z, top_k, top_p)
        mass = z.softmax(-1).masked_fill(kept == 0, 0.0).sum(-1)  # [R] the full softmax's mass on the drawable
        tokens = _race(kept)
        return tokens, z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1), mass
    probs = z.softmax(-1)
    tokens = _race(probs, keep=True)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log(), ones


def _race(probs: Tensor, keep: bool = False) -> Tensor:
    """argmax_i p_i / E_i, E_i ~ Exp(1) (a draw from p); ``keep``: ``probs`` is left as it was."""
    draws = torch.empty_like(probs).exponential_(1.0)
    return (torch.div(probs, draws, out=draws) if keep else probs.div_(draws)).argmax(-1)


def _truncated(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """softmax(z) cut to its top-k, then to the smallest prefix whose mass reaches ``top_p`` (not renormalised:
    the exponential race needs no normalisation)."""
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
