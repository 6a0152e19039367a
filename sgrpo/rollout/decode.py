"""A lean sampling loop for rollouts: shared prompt prefill, a KV cache grown in blocks, finished rows dropped.

``transformers``' ``generate`` is general (beam search, logits processors, streaming, stopping
criteria); a GRPO rollout needs none of that and pays for it on every token. ``decode`` runs the
model's own forward (any architecture with a ``DynamicCache``) and differs from ``generate`` in
four ways that change cost, not the distribution sampled:

1. Each distinct prompt is prefilled once, then its keys and values are copied to its G rows
   (``generate`` prefills every row, G times the prompt compute).
2. Keys and values go into buffers grown a block of positions at a time (keys in the values'
   dtype) and are read back as views (``DynamicCache`` concatenates the whole cache again at every
   token; allocating prompt + ``max_new_tokens`` up front holds memory for rows that end early).
3. A row that has emitted EOS stops being computed: when the running rows fall to ``compact_below``
   of the batch, finished rows are dropped from the batch and the cache (checked every few tokens
   on an accelerator, so the host does not wait for the device at every token).
4. Sampling is exactly softmax(logits / temperature) restricted by top-k / top-p, the distribution
   the policy loss assumes; nothing from the model's ``generation_config`` (repetition penalty,
   default top-p ...) is applied behind the caller's back. A row's first ``min_new_tokens`` tokens
   cannot be EOS.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from sgrpo.distributed import is_sharded, world_size
from sgrpo.model.head import LMHead
from sgrpo.model.logprobs import final_hidden_states
from sgrpo.rollout.sampling import sample_with_logprobs
from sgrpo.rollout_stop import ROLLOUT_STOP, RolloutStopped

if TYPE_CHECKING:
    from sgrpo.rollout.graphs import GraphCache


class BlockLayer(DynamicLayer):
    """A full-attention cache layer in buffers grown in whole ``block`` s, at least doubling, up to ``capacity``.

    Keys and values are views of the buffers' filled positions. The buffers hold the positions written
    so far rounded up to a block, or twice what they held when that is more (not prompt + ``max_new_tokens``
    from the start: most rows of a rollout end early, and finished rows are dropped from the batch); keys are
    stored in the values' dtype (under autocast rotary embeddings promote keys to float32; attention casts them
    back to the values' dtype anyway, so rounding them once on write gives the same numbers in half the key
    memory).
    """

    def __init__(self, capacity: int, block: int = 256) -> None:
        super().__init__()
        self.capacity, self.block, self.length = capacity, block, 0
        self.key_buffer: Tensor | None = None
        self.value_buffer: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = value_states.dtype, value_states.device
        n, heads, _, dim = key_states.shape
        self.key_buffer = value_states.new_empty(n, heads, 0, dim)
        self.value_buffer = value_states.new_empty(n, value_states.shape[1], 0, value_states.shape[3])
        self.is_initialized = True

    def reserve(self, positions: int) -> None:
        """Grow the buffers to hold ``positions`` positions: rounded up to a block, and at least doubled (at most
        ``capacity``), so a rollout of n tokens copies its cache O(log n) times, not n / block times."""
        if positions > self.capacity:
            raise RuntimeError(f"KV cache full: {positions} positions > capacity {self.capacity}")
        if positions > self.key_buffer.shape[2]:
            size = min(self.capacity, max(-(-positions // self.block) * self.block, 2 * self.key_buffer.shape[2]))
            self.key_buffer = self._copy(self.key_buffer, size)
            self.value_buffer = self._copy(self.value_buffer, size)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self.key_buffer[:, :, self.length : end] = key_states  # in the values' dtype
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows ``indices`` (in that order; repeats allowed), copying only the filled positions."""
        if self.is_initialized:
            self.key_buffer = self._copy(self.key_buffer, self.key_buffer.shape[2], indices)
            self.value_buffer = self._copy(self.value_buffer, self.value_buffer.shape[2], indices)
            self._views()

    def _copy(self, buffer: Tensor, size: int, rows: Tensor | None = None) -> Tensor:
        """A buffer of ``size`` positions holding the filled positions of ``buffer`` (of its rows ``rows``)."""
        n = buffer.shape[0] if rows is None else len(rows)
        out = buffer.new_empty((n, buffer.shape[1], size, buffer.shape[3]))
        filled = buffer[:, :, : self.length]
        out[:, :, : self.length] = filled if rows is None else filled.index_select(0, rows)
        return out

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]


def kv_cache(model: nn.Module, capacity: int, block: int = 256) -> DynamicCache:
    """The model's ``DynamicCache`` with every plain full-attention layer replaced by a ``BlockLayer``.

    Other layer kinds (sliding windows, linear attention) keep their own implementation.
    """
    cache = DynamicCache(config=model.config)
    cache.layers = [BlockLayer(capacity, block) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def select_rows(cache: DynamicCache, indices: Tensor) -> None:
    for layer in cache.layers:
        layer.batch_select_indices(indices)


NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class LlamaFamilyStep:
    """One decode step of a Llama-family model (Llama, Qwen2, Qwen3, Mistral) without the HF call stack.

    The model's own modules (norms, projections, MLP) and rotary table, with attention written out
    over the block cache: a decode step of a small batch is dominated by per-call overhead
    (mask building, attention dispatch, cache bookkeeping), which this skips. Attention is SDPA's (scores and
    softmax in float32).
    ``supported`` says when it applies (full attention in every layer, a position-independent
    rotary table, a plain unwrapped model); otherwise ``decode`` uses the model's own forward.
    Tested against the HF forward (``tests/test_decode.py``).
    """

    def __init__(self, model: nn.Module, cache: DynamicCache, capacity: int, head: LMHead | None = None) -> None:
        self.model, self.cache, base = model, cache, model.model
        self.head = LMHead.of(model) if head is None else head
        config = model.config.get_text_config(decoder=True)
        device = base.embed_tokens.weight.device
        table_ids = torch.arange(capacity, device=device).unsqueeze(0)
        cos, sin = base.rotary_emb(base.embed_tokens.weight[:1].unsqueeze(0), table_ids)  # [1, cap, D]
        self.cos, self.sin = cos[0], sin[0]
        self.layers = [(layer.self_attn, layer.mlp, layer) for layer in base.layers]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5

    @staticmethod
    def supported(model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) not in NATIVE_MODEL_TYPES:
            return False
        if is_sharded(model) or not hasattr(model, "model"):
            return False  # FSDP2 gathers parameters in the module hooks this path bypasses
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return False
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True):
            return False
        return getattr(model.model.rotary_emb, "rope_type", "default") in _STATIC_ROPE

    def __call__(self, tokens: Tensor, positions: Tensor, key_mask: Tensor) -> Tensor:
        """float32 logits ``[R, V]`` of one new token per row (``sgrpo.model.head``); ``key_mask`` ``[R, L+1]`` bool."""

        base = self.model.model
        x = base.embed_tokens(tokens).unsqueeze(1)  # [R, 1, H]
        r, d = x.shape[0], self.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [R, 1, D]
        bias = torch.zeros(key_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~key_mask, float("-inf"))
        bias = bias[:, None, None, :]  # [R, 1, 1, L+1]: every head and query of a row
        for cache_layer, (attn, mlp, layer) in zip(self.cache.layers, self.layers):
            h = layer.input_layernorm(x)
            q, k, v = (proj(h).view(r, 1, -1, d) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            if getattr(attn, "q_norm", None) is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [R, heads, 1, D]
            q = q * cos.unsqueeze(1) + _rotate_half(q) * sin.unsqueeze(1)
            k = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
            keys, values = cache_layer.update(k, v.transpose(1, 2))  # [R, kv_heads, L+1, D]
            # the query heads of a key/value head as its queries (one token: no causal mask), so no key is repeated;
            # SDPA's kernels take the scores in float32 (baddbmm's were rounded to bf16 before the softmax: ~0.006
            # mean |log-prob| from the trainer's forward on a bf16 model, against ~0.0001 for the model's own step)
            qg = q.reshape(r, keys.shape[1], -1, d)  # [R, kv_heads, group, D]
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=self.scaling)
            x = x + attn.o_proj(out.reshape(r, 1, -1))
            x = x + mlp(layer.post_attention_layernorm(x))
        return self.head(base.norm(x)[:, -1])


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def decode(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    row_prompt: Tensor,
    max_new_tokens: int,
    eos: Sequence[int],
    pad: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    min_new_tokens: int = 0,
    compact_below: float = 0.75,
    native_step: bool = True,
    cuda_graphs: bool = False,
    graph_cache: GraphCache | None = None,
    check_every: int | None = None,
    cache_block: int = 256,
    nucleus_mass: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """New tokens ``[R, max_new_tokens]`` (``pad`` after a row's EOS) for rows ``row_prompt`` ``[R]``, and
    their log-probs ``[R, max_new_tokens]`` float32 under softmax(logits / temperature) (0 after EOS).

    ``prompt_ids``/``prompt_mask`` ``[U, P]``: the distinct prompts, left-padded; row r continues
    prompt ``row_prompt[r]``. Rows stop at their first EOS (from token ``min_new_tokens`` on).
    Logits come from ``sgrpo.model.head`` (float32 logits from the compute dtype's matmul, the model's own
    transform), as in the policy loss, so the sampler and the trained policy are one distribution.
    A sharded model (FSDP2) gathers its parameters in every forward, a collective: then the loop
    ends only when no process has a running row, and a process whose rows are all done keeps
    running forwards on one finished row (its tokens are discarded), so the gathers pair up.
    ``cuda_graphs`` (with the native step) runs fixed-shape steps (``sgrpo.rollout.graphs.StaticSteps``),
    replayed as CUDA graphs on a GPU and run eagerly elsewhere; with ``graph_cache`` (``GraphCache``) the steps
    and their graphs are kept from one call to the next.

    The KV cache grows ``cache_block`` positions at a time (``BlockLayer``). Which rows are still
    running is read on the host (a device sync) every ``check_every`` tokens (default
    ``check_interval``): only then can the loop end or drop finished rows. In between, finished rows
    stay in the batch and emit ``pad`` with log-prob 0; tokens and log-probs do not depend on the
    interval, except through the drops, which happen at check steps only (a sampled row then draws
    other random numbers: the same distribution, not the same draws).
    Under FSDP2 every process checks at the same steps (one all-reduce per check). At each check a stop asked for
    during a training rollout of several processes (``sgrpo.rollout_stop.RolloutStop``) ends the loop
    (``RolloutStopped``): under FSDP2 on every process at once, read in that all-reduce.
    ``nucleus_mass`` ``[R, max_new_tokens]`` float32, if given, receives each token's kept mass (``sample``;
    0 after EOS); the log-probs stay the full softmax's, as the policy loss computes them.
    """
    device = prompt_ids.device
    synced = is_sharded(model) and world_size() > 1
    rows, (_, p) = row_prompt.shape[0], prompt_ids.shape
    eos_t = torch.as_tensor(list(eos), device=device)
    every = check_interval(device) if check_every is None else check_every
    if every < 1 or cache_block < 1:
        raise ValueError(f"check_every and cache_block must be >= 1, got {every}, {cache_block}")
    cache = kv_cache(model, p + max_new_tokens, cache_block)
    hidden = final_hidden_states(model, prompt_ids, prompt_mask, cache)[:, -1]  # [U, H]
    select_rows(cache, row_prompt)  # each prompt's keys and values, once per row
    mask = torch.ones(rows, p + max_new_tokens, dtype=prompt_mask.dtype, device=device)
    mask[:, :p] = prompt_mask.index_select(0, row_prompt)
    head = LMHead.of(model)  # the loss's head, its weight cast to the compute dtype once for the whole loop
    steps = DecodeSteps(model, cache, mask, p, native_step, cuda_graphs, head, graph_cache)
    logits = head(hidden).index_select(0, row_prompt)  # [R, V] float32
    position = prompt_mask.sum(-1).index_select(0, row_prompt)  # [R]: the next token's position
    tokens = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, dtype=logits.dtype, device=device)  # float64 for a float64 model
    alive = torch.arange(rows, device=device)  # original index of each row still in the batch
    running = torch.ones(rows, dtype=torch.bool, device=device)  # per batch row: not yet finished
    for t in range(max_new_tokens):
        if t < min_new_tokens:
            logits[:, eos_t] = float("-inf")
        next_tokens, next_logprobs, mass = sample_with_logprobs(logits, temperature, top_k, top_p, greedy)
        logprobs[alive, t] = next_logprobs.masked_fill_(~running, 0.0)
        if nucleus_mass is not None:
            nucleus_mass[alive, t] = mass.masked_fill(~running, 0.0)
        next_tokens = next_tokens.masked_fill(~running, pad)
        tokens[alive, t] = next_tokens
        running &= ~torch.isin(next_tokens, eos_t)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % every == 0:  # the host reads the running rows: a device sync, so not at every token
            n_running = int(running.sum())
            if not (running_anywhere(n_running > 0, device) if synced else n_running > 0):
                break
            if not synced:  # (synced: a stop is learnt in the all-reduce, by every process at once)
                ROLLOUT_STOP.check()  # a stop asked for: leave the rollout (sgrpo.rollout_stop.RolloutStop)
            if n_running < compact_below * running.numel():  # drop finished rows from the batch and the cache
                keep = running.nonzero().squeeze(-1)
                if n_running == 0:  # done here but not everywhere (synced): one finished row keeps the forwards
                    keep = keep.new_zeros(1)
                steps.compact(keep)
                alive, next_tokens, position, running = alive[keep], next_tokens[keep], position[keep], running[keep]
        logits = steps(next_tokens, position, t)
        position = position + 1
    return tokens, logprobs


def running_anywhere(running: bool, device: torch.device) -> bool:
    """Whether any process still has a running row (a collective: every process of a lockstep decode calls it at
    the same steps); a stop requested on any process (``ROLLOUT_STOP``) is learnt in the same all-reduce, and
    every process then leaves the rollout after the same forward (``RolloutStopped``)."""
    flags = torch.tensor([float(running), float(ROLLOUT_STOP.requested)], device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    if flags[1].item():
        raise RolloutStopped
    return bool(flags[0].item())


def check_interval(device: torch.device) -> int:
    """Tokens between host reads of the running rows: 8 on an accelerator, where each read stalls the host
    until the device has finished the step (no kernel launches queue up meanwhile); 1 on the CPU, where
    the read costs nothing and finished rows are dropped at the earliest step."""
    return 1 if device.type == "cpu" else 8


class DecodeSteps:
    """The decode step of the rows still running, by the fastest path that applies to ``model``.

    Fixed-shape steps replayable as CUDA graphs (``cuda_graphs``, ``sgrpo.rollout.graphs.StaticSteps``), the
    native Llama-family step (``LlamaFamilyStep``), or the model's own forward on the cache. ``mask``
    ``[R, P + max_new_tokens]``: each row's prompt mask, then ones.
    """

    def __init__(self, model: nn.Module, cache: DynamicCache, mask: Tensor, prompt_length: int, native: bool,
                 cuda_graphs: bool, head: LMHead, graph_cache: GraphCache | None = None) -> None:  # fmt: skip
        self.model, self.cache, self.mask, self.p, self.head = model, cache, mask, prompt_length, head
        self.native = self.static = None
        if native and LlamaFamilyStep.supported(model):
            if cuda_graphs:
                from sgrpo.rollout.graphs import StaticSteps

                key_mask = torch.cat([mask[:, :prompt_length], torch.zeros_like(mask[:, prompt_length:])], 1)
                if graph_cache is not None:  # kept across rollouts: the prompts are copied into its buffers
                    self.static = graph_cache.steps(model, cache, key_mask, LlamaFamilyStep, head)
                else:
                    for layer in cache.layers:  # fixed addresses for the graphs: every position allocated up front
                        layer.reserve(mask.shape[1])
                    step = functools.partial(LlamaFamilyStep, head=head)
                    self.static = StaticSteps(model, cache, key_mask, step, graphs=True)
            else:
                self.native = LlamaFamilyStep(model, cache, mask.shape[1], head)

    def compact(self, keep: Tensor) -> None:
        """Keep rows ``keep`` (in that order) in the batch and the cache."""
        if self.static is not None:
            self.static.compact(keep)
        else:
            select_rows(self.cache, keep)
        self.mask = self.mask[keep]

    def __call__(self, tokens: Tensor, position: Tensor, t: int) -> Tensor:
        """float32 logits ``[R, V]`` after new token ``t`` (``tokens`` ``[R]`` at ``position`` ``[R]``)."""
        if self.static is not None:
            return self.static(tokens, position, self.p + t)
        if self.native is not None:
            return self.native(tokens, position, self.mask[:, : self.p + t + 1].bool())
        step_mask = self.mask[:, : self.p + t + 1]
        hidden = final_hidden_states(self.model, tokens.unsqueeze(-1), step_mask, self.cache, position.unsqueeze(-1))
        return self.head(hidden[:, -1])
