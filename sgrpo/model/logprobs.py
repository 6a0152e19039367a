"""Log-probs of completion tokens under a model, and how far a sampler's log-probs are from the trainer's.

``completion_logprobs`` runs the model's own forward for the hidden states (packed rows,
``sgrpo.model.packing``; or each distinct prompt once when prompts repeat) and the LM head through
``sgrpo.model.head`` (the compute dtype's operands, float32 logits, the model's own logit transform,
chunked with a hand-written backward). ``packing_problem`` checks a model's packed forward once.
``logprob_gap`` measures a sampler against the trainer on the sampled tokens. Pure functions of
tensors and modules: nothing here knows about trainers or configs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sgrpo.distributed import is_sharded
from sgrpo.model.head import LogitTransform, TokenLogprobs, head_dtype
from sgrpo.model.packing import (
    MASKED_ATTENTION,
    VARLEN_ATTENTION,
    attention_implementation,
    one_row,
    pack,
    pack_shared,
    shared_attention_mask,
    shared_pays,
    sharing_problem,
)


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
    share_prompts: bool = True,
    packing: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the completion tokens under ``model``, ``[N, T]`` each.

    ``input_ids``/``attention_mask`` ``[N, P+T]``, ``completion_mask`` ``[N, T]``. Logits are the
    model's own (``sgrpo.model.head``: float32 from the compute dtype's matmul, with its output transform, as
    the rollout's sampler computes them) over ``temperature``, the
    distribution the rollout samples from (truncated sampling is refused for training). The LM head runs
    only on completion tokens, ``chunk_size`` tokens at a time (by default as many as fit fp32
    logits in ``chunk_mib`` MiB) in ``TokenLogprobs``, so neither the forward nor the backward
    ever holds ``[N, T, vocab]`` logits. Padding gets 0. With ``packing``, the rows' real tokens run
    packed (``sgrpo.model.packing``; no padding computed), and with ``share_prompts`` too, each group's prompt
    once (``pack_shared``: a block mask, position ids restarting at the prompt's end for each completion) where
    the model takes the mask (``sharing_problem``) and the cost model says it pays (``shared_pays``); without
    ``packing``, with ``share_prompts``, rows with the same prompt run it once (``completion_hidden_states``).
    """
    t = completion_mask.shape[1]
    head = model.get_output_embeddings()
    mask = completion_mask.bool()
    if chunk_size is None:
        chunk_size = logit_chunk_tokens(chunk_mib, head.weight.shape[0], head.weight.device.type)
    if packing:
        hidden_size = getattr(model.config, "hidden_size", None)
        share = share_prompts and sharing_problem(model) is None
        if share and shared_pays(attention_mask, mask, input_ids, hidden_size):
            packed = pack_shared(input_ids, attention_mask, mask, hidden_size)
            block = shared_attention_mask(model, packed)
        else:
            packed, block = pack(input_ids, attention_mask, mask, one_row(model), hidden_size), None
        hidden = final_hidden_states(model, packed.input_ids, block, position_ids=packed.position_ids)
        h = gather_rows(hidden.reshape(-1, hidden.shape[-1]), packed.hidden_index)  # [M, H], as hidden[mask]
    else:
        hidden = completion_hidden_states(model, input_ids, attention_mask, t, share_prompts)  # [N, T, H]
        h = hidden[mask]  # [M, H]
    targets = input_ids[:, -t:][mask]  # [M]
    token_logp, token_entropy = TokenLogprobs.apply(
        h, head.weight, head.bias, targets, temperature, chunk_size, with_entropy, LogitTransform.of(model),
        head_dtype(head.weight),
    )
    logp = h.new_zeros(mask.shape, dtype=token_logp.dtype)  # float32 (float64 for a float64 model)
    entropy = h.new_zeros(mask.shape, dtype=token_logp.dtype) if with_entropy else None
    if h.shape[0]:
        logp = logp.masked_scatter(mask, token_logp)
        if entropy is not None:
            entropy = entropy.masked_scatter(mask, token_entropy)
    return logp, entropy


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along dim 0 by the gather whose backward sums repeated indices in a fixed order on ``x``'s device.

    A shared prompt's last hidden state is gathered once per completion, so ``index`` repeats. PyTorch documents each
    gather's backward as order-free (atomic adds timed by the threads) on one device: ``x[index]`` on a CPU
    (``index_put`` accumulate with more than one thread), ``index_select`` on CUDA (``index_add_``). On a CPU the
    first made a seeded quickstart land elsewhere on a loaded machine; so ``index_select`` there, ``[index]`` elsewhere.
    """
    return x.index_select(0, index) if x.device.type == "cpu" else x[index]


#: on an accelerator, logits chunks come in whole tiles of this many tokens, and at least ``ACCELERATOR_MIN_TOKENS``
ACCELERATOR_TILE_TOKENS, ACCELERATOR_MIN_TOKENS = 256, 1024


def logit_chunk_tokens(chunk_mib: float, vocab: int, device_type: str) -> int:
    """Tokens per chunk of float32 logits: as many as fit ``chunk_mib`` MiB (``n = chunk_mib 2^20 / (4 V)``).

    On an accelerator (not ``cpu``), ``n`` is rounded up to whole 256-token tiles and to at least 1,024: each
    chunk's backward adds a ``[V, H]`` float32 product into the weight's gradient, reading and writing ``8 V H``
    bytes for ``6 n V H`` flops, so a chunk of ``n`` tokens does ``0.75 n`` flops per byte; below about 1,000
    tokens a GPU (~200-300 flops per byte of memory bandwidth in bf16) waits on memory. 128 MiB at Qwen's
    151,936-token vocabulary: 220 tokens on CPU, 1,024 on a GPU (two 594 MiB buffers at most).
    """
    n = max(1, int(chunk_mib * 2**20) // (4 * vocab))
    if device_type == "cpu":
        return n
    n = -(-n // ACCELERATOR_TILE_TOKENS) * ACCELERATOR_TILE_TOKENS
    return max(n, ACCELERATOR_MIN_TOKENS)


def completion_hidden_states(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, t: int, share_prompts: bool = True
) -> Tensor:
    """Hidden states ``[N, T, H]`` that predict the last ``t`` tokens of ``input_ids`` ``[N, P+T]``.

    GRPO's rows come in groups with one prompt, and the prompt's keys and values do not depend on
    the completion. With ``share_prompts``, each distinct prompt (ids and mask) runs once; its
    KV cache is copied to its rows (a differentiable index, so gradients from every completion
    flow back into the one prompt forward) and the completions run on top of it. Same values as
    the full forward up to float summation order; fewer FLOPs and activations when prompts repeat.
    Falls back to the full forward when no prompt repeats, or the model's cache is not a plain
    full-attention ``DynamicCache``, or HF gradient checkpointing (which drops caches) is on, or the
    model is FSDP2-sharded (its gathers and reduce-scatters must pair up across processes, whose
    micro-batches may share prompts differently).
    """
    p = input_ids.shape[1] - t
    full = lambda: final_hidden_states(model, input_ids[:, :-1], attention_mask[:, :-1])[:, -t:]  # noqa: E731
    if not share_prompts or p < 1 or t < 2 or getattr(model, "is_gradient_checkpointing", False):
        return full()
    if is_sharded(model):  # FSDP2: processes must run the same forwards (collectives), one per micro-batch
        return full()
    keys = torch.cat([input_ids[:, :p], attention_mask[:, :p].to(input_ids.dtype)], 1)
    distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
    if distinct.shape[0] == input_ids.shape[0]:
        return full()
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return full()
    prompt_ids, prompt_mask = distinct[:, :p], distinct[:, p:].to(attention_mask.dtype)
    prompt_hidden = final_hidden_states(model, prompt_ids, prompt_mask, cache)  # [U, P, H]
    for layer in cache.layers:  # each prompt's keys and values, once per row
        layer.keys, layer.values = gather_rows(layer.keys, inverse), gather_rows(layer.values, inverse)
    mask = attention_mask[:, :-1]
    positions = position_ids_from_mask(mask)[:, p:]
    rest = final_hidden_states(model, input_ids[:, p:-1], mask, cache, positions)  # [N, T-1, H]
    return torch.cat([gather_rows(prompt_hidden[:, -1:], inverse), rest], 1)


def final_hidden_states(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, cache=None, position_ids: Tensor | None = None
) -> Tensor:
    """The decoder's last hidden states ``[N, S, H]``, through the model's own forward.

    The root forward runs (so wrappers such as FSDP2 gather the root's parameters, and keep them
    gathered until backward) with logits for no position (an empty ``logits_to_keep`` index: the
    head runs in ``sgrpo.model.head``); a hook on the decoder hands back its output. With ``cache`` (a
    ``DynamicCache``), the forward extends it: ``attention_mask`` then covers cached + new positions
    and ``position_ids`` those of the new tokens. Without ``attention_mask`` (packed rows: ``position_ids``
    restart at each sequence) there is no cache either, so transformers keeps the sequences apart; a 4-D
    ``attention_mask`` (or flex attention's ``BlockMask``: ``sgrpo.model.packing.shared_attention_mask``) goes to
    the attention as it is (transformers' ``masking_utils`` passes a 4-D mask through).
    """
    captured: list[Tensor] = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask) if position_ids is None else position_ids,
            past_key_values=cache,
            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
            use_cache=cache is not None,
        )
    finally:
        handle.remove()
    return captured[-1]


def packing_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot run packed log-probs, or None; a few small forwards (collectives under FSDP2).

    Refused: an attention implementation outside ``MASKED_ATTENTION`` and ``VARLEN_ATTENTION`` (nothing
    would keep packed sequences apart). Then a probe of three sequences (two share a packed row): changing
    one sequence's tokens must leave the other's log-probs unchanged bit for bit (no cross-sequence
    attention), and the packed log-probs must be finite and within ``tolerance`` of each sequence run alone,
    unpadded (1e-4 in float32/float64, 0.125 in half precision: the positions are right). Run in eval mode
    (dropout off), without gradients.
    """
    impl = attention_implementation(model)
    if impl not in MASKED_ATTENTION + VARLEN_ATTENTION:
        return f"attention implementation {impl!r} cannot keep packed sequences apart"
    weight = model.get_output_embeddings().weight
    half = head_dtype(weight).itemsize < 4
    tolerance = 0.125 if half else 1e-4
    vocab = model.get_input_embeddings().weight.shape[0]
    device = weight.device
    ids = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(0), device="cpu").to(device)
    attention = torch.tensor([[1] * 9, [0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0, 0]], device=device)
    completion = attention[:, 4:].bool()  # lengths 8, 4, 3 in rows of 8: the 4 and the 3 share one
    changed = ids.clone()
    changed[1] = (ids[1] + 1) % vocab
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = completion_logprobs(model, ids, attention, completion, packing=True)[0]
            other = completion_logprobs(model, changed, attention, completion, packing=True)[0]
            alone = [completion_logprobs(model, *(x[i : i + 1, attention[i] > 0] for x in (ids, attention)),
                                         completion[i : i + 1, : int(completion[i].sum())], share_prompts=False)[0]
                     for i in range(3)]
    finally:
        model.train(training)
    if not torch.equal(packed[[0, 2]], other[[0, 2]]):
        return f"with {impl} attention, one packed sequence's log-probs change with another's tokens"
    gap = max(float((packed[i, : a.shape[1]] - a[0]).abs().max()) for i, a in enumerate(alone))
    if not gap <= tolerance:  # NaN fails too
        return f"with {impl} attention, packed log-probs differ from unpadded ones by {gap:.3g} (> {tolerance:g})"
    return None


def logprob_gap(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums that add up over micro-batches: how far the sampler's log-probs are from the trainer's.

    With ``d = logp_sampler - logp_trainer`` on the tokens of ``mask``: ``kl`` = sum of the k3 estimate
    of KL(sampler || trainer), ``exp(-d) - 1 + d``; ``abs_diff`` = sum |d|; ``max_abs`` = max |d|;
    ``tokens`` = their count. ``logprob_mismatch`` turns them into means.
    """
    d = (sampler_logp.detach().float() - trainer_logp.detach().float())[mask.bool()]
    return {
        "kl": (torch.expm1(-d) + d).sum(),
        "abs_diff": d.abs().sum(),
        "max_abs": d.abs().amax() if d.numel() else d.new_zeros(()),
        "tokens": d.new_tensor(float(d.numel())),
    }


def logprob_mismatch(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``logprob_gap`` as means over the tokens (``kl``, ``abs_diff``) and the largest gap (``max_abs``)."""
    return gap_means(logprob_gap(trainer_logp, sampler_logp, mask))


def gap_means(gap: dict[str, Tensor]) -> dict[str, Tensor]:
    """Means over tokens of ``logprob_gap``'s sums (``kl``, ``abs_diff``) and its ``max_abs``."""
    tokens = gap["tokens"].clamp_min(1.0)
    return {"kl": gap["kl"] / tokens, "abs_diff": gap["abs_diff"] / tokens, "max_abs": gap["max_abs"]}


def merge_gaps(a: dict[str, Tensor] | None, b: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """Two ``logprob_gap`` results (either may be None) as one: sums add, maxima take the larger."""
    if a is None or b is None:
        return a if b is None else b
    return {k: torch.maximum(a[k], b[k]) if k == "max_abs" else a[k] + b[k] for k in a}
