"""Packed sequences: a micro-batch's real tokens laid end to end in rows, no padding computed.

The padded path runs ``[N, W]`` (every row as wide as the micro-batch's widest); ``pack`` lays each
row's real tokens (those the log-probs need: the prompt's, and the completion's up to the last
trained token) one after another in rows, position ids restarting at 0 at each sequence, and no
attention mask. Transformers then keeps sequences apart itself: for ``eager``, ``sdpa`` and
``flex_attention`` it builds a block-diagonal causal mask from the restarting position ids
(``masking_utils.find_packed_sequence_indices``, per row), for ``flash_attention_*`` it runs the
varlen kernel, which it does only for a batch of one row. Two conditions, both met by
``sgrpo.model.logprobs.final_hidden_states``: no attention mask and no KV cache (with ``use_cache``
on, transformers builds a cache before the mask and skips the packed mask: one sequence would attend
into the one before it).

Rows are filled first-fit by decreasing length. Their width is the padded forward's (W) or another
(``sgrpo.model.rows.row_width``): a dense block-diagonal mask costs attention over the whole row, so wider rows skip
more padding in the linear layers but pay more attention; a cost model picks. At width W each token's
attention reduces over as many keys as in the padded path, so the per-token results are the padded
path's bit for bit where the kernels allow (eager and SDPA on CPU, float32); rows of another width sum
in another order (float32: ~1e-7 apart). A flash-attention model gets one row (its varlen kernel costs
the sum of each sequence's own square).

``sgrpo.model.logprobs.packing_problem`` says why a model cannot pack, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sgrpo.model.rows import first_fit, layout_cost, row_width, segment_parts

#: attention implementations that build the block-diagonal mask from restarting position ids (per row)
MASKED_ATTENTION = ("eager", "sdpa", "flex_attention")
#: attention implementations that run the varlen kernel from restarting position ids (one row only)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", "paged_attention")


@dataclass(frozen=True)
class Packed:
    """A micro-batch packed into ``[R, C]`` rows.

    ``hidden_index`` ``[M]``: for each trained completion token (row-major over the completion mask,
    the order of ``hidden[mask]``), the flat index into ``[R * C]`` of the hidden state that predicts it.
    """

    input_ids: Tensor  # [R, C]
    position_ids: Tensor  # [R, C]: 0, 1, ... within each sequence, restarting at each (and on the tail padding)
    hidden_index: Tensor  # [M]
    tokens: int  # real tokens packed (the rest of R * C is tail padding)


def attention_implementation(model: nn.Module) -> str | None:
    """The model's attention implementation (``config._attn_implementation``), or None when it has none."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def one_row(model: nn.Module) -> bool:
    """Whether ``model`` must get a single packed row (flash-attention's varlen path takes only a batch of 1)."""
    return attention_implementation(model) in VARLEN_ATTENTION


def sequence_lengths(attention_mask: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Which columns each row runs, ``keep`` ``[N, P+T]`` bool, and their count ``[N]``.

    A row runs its real tokens (``attention_mask``) up to the one before its last ``completion_mask``
    token (the last token is predicted, never run); a row without trained tokens runs none.
    """
    n, total = attention_mask.shape
    t = completion_mask.shape[1]
    mask = completion_mask.bool()
    last = torch.where(mask.any(-1), t - 1 - mask.flip(-1).int().argmax(-1), -1)  # last trained column or -1
    stop = total - t + last  # [N]: columns < stop run
    columns = torch.arange(total, device=attention_mask.device)
    keep = attention_mask.bool() & (columns < stop.unsqueeze(-1)) & mask.any(-1, keepdim=True)
    return keep, keep.sum(-1)


def pack(
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    single_row: bool = False,
    hidden_size: int | None = None,
) -> Packed:
    """``input_ids``/``attention_mask`` ``[N, P+T]``, ``completion_mask`` ``[N, T]`` packed (module docstring).

    Rows are ``row_width`` wide (``P+T-1``, the padded forward's width, without ``hidden_size``), or one
    row of every token with ``single_row``. Tail padding holds token 0 at positions 0, 1, ...: a
    sequence of its own that no real token sees.
    """
    device = input_ids.device
    keep, lengths = sequence_lengths(attention_mask, completion_mask)
    count = int(lengths.sum())
    padded_width = max(input_ids.shape[1] - 1, 1)
    width = max(count, 1) if single_row else row_width(lengths.tolist(), padded_width, hidden_size)
    placed = first_fit(lengths.tolist(), width)
    rows = 1 + max((r for r, _ in placed), default=0)
    base = torch.tensor([r * width + o for r, o in placed], dtype=torch.long, device=device)  # [N] flat start
    within = keep.long().cumsum(-1) - 1  # [N, P+T]: a kept column's index within its sequence
    dest = (base.unsqueeze(-1) + within)[keep]  # [count], row-major over (row, column) as input_ids[keep]
    flat_ids = torch.zeros(rows * width, dtype=input_ids.dtype, device=device)
    flat_ids[dest] = input_ids[keep]
    used = torch.zeros(rows * width, dtype=torch.bool, device=device)
    used[dest] = True
    # positions: within-sequence index on real tokens; tail padding restarts at 0 (its own sequence)
    flat_pos = torch.zeros(rows * width, dtype=torch.long, device=device)
    flat_pos[dest] = within[keep]
    tail = (~used).view(rows, width).long()  # each row's sequences start at offset 0: the padding is a suffix
    flat_pos = torch.where(used, flat_pos, ((tail.cumsum(-1) - 1) * tail).view(-1))
    t = completion_mask.shape[1]
    predictor = within[:, -t - 1 : -1]  # [N, T]: the index within its sequence of the column before each token
    hidden_index = (base.unsqueeze(-1) + predictor)[completion_mask.bool()]
    return Packed(flat_ids.view(rows, width), flat_pos.view(rows, width), hidden_index, count)


def layout_tokens(
    attention_mask: Tensor, completion_mask: Tensor, single_row: bool = False, hidden_size: int | None = None
) -> tuple[int, int, int]:
    """A micro-batch's tokens: real ones, as the padded forward runs them (``N x (P+T-1)``) and as ``pack``
    (same arguments) lays them out (its rows x their width)."""
    _, lengths = sequence_lengths(attention_mask, completion_mask)
    real, width = int(lengths.sum()), max(attention_mask.shape[1] - 1, 1)
    if single_row:
        return real, attention_mask.shape[0] * width, real
    width_packed = row_width(lengths.tolist(), width, hidden_size)
    rows = 1 + max((r for r, _ in first_fit(lengths.tolist(), width_packed)), default=0)
    return real, attention_mask.shape[0] * width, rows * width_packed


@dataclass(frozen=True)
class SharedPacked:
    """A micro-batch packed with each group's prompt once: segments ``[prompt, c1, ..., cG]`` in ``[R, C]`` rows.

    ``segment`` and ``branch`` ``[R, C]`` say which segment a slot belongs to (tail padding: a segment of its own
    per slot) and which branch of it (0: the prompt, ``i + 1``: the completion of micro-batch row ``i``);
    ``allowed`` turns them into the attention mask. ``hidden_index`` as in ``Packed``.
    """

    input_ids: Tensor  # [R, C]
    position_ids: Tensor  # [R, C]: the prompt's 0..Lp-1, each completion's Lp, Lp+1, ... (restarting per branch)
    segment: Tensor  # [R, C]
    branch: Tensor  # [R, C]
    hidden_index: Tensor  # [M]
    tokens: int  # real tokens packed (each prompt once)

    def allowed(self) -> Tensor:
        """``[R, 1, C, C]`` bool: query ``q`` sees key ``k`` iff they share a segment, ``k <= q``, and ``k`` is in the
        prompt or in ``q``'s own branch (the prompt is causal; a completion sees the prompt and itself causally)."""
        c = self.segment.shape[1]
        causal = torch.ones(c, c, dtype=torch.bool, device=self.segment.device).tril()
        same = self.segment.unsqueeze(-1) == self.segment.unsqueeze(-2)  # [R, Cq, Ck]
        branch = (self.branch.unsqueeze(-2) == 0) | (self.branch.unsqueeze(-1) == self.branch.unsqueeze(-2))
        return (same & branch & causal).unsqueeze(1)


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> tuple[Tensor, int]:
    """``[N]`` each row's group (rows with identical prompt ids and mask over the first ``prompt_length`` columns) and
    the number of groups."""
    keys = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].to(input_ids.dtype)], 1)
    distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
    return inverse, distinct.shape[0]


@dataclass(frozen=True)
class SharedParts:
    """``pack_shared``'s segments before placement: ``keep`` ``[N, P+T]`` (``sequence_lengths``); per row its
    segment (-1: no trained token) and the completion tokens of its segment's earlier rows; per segment its
    length (the prompt once plus its rows' completions)."""

    keep: Tensor
    part: list[int]
    offset: list[int]
    lengths: list[int]


def shared_parts(
    input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, hidden_size: int | None
) -> SharedParts:
    """Rows grouped by prompt (``prompt_groups``), each group cut by ``segment_parts``."""
    keep, _ = sequence_lengths(attention_mask, completion_mask)
    p = attention_mask.shape[1] - completion_mask.shape[1]
    group = prompt_groups(input_ids, attention_mask, p)[0].tolist()
    active = completion_mask.bool().any(-1).tolist()
    prompt = attention_mask[:, :p].bool().sum(-1).tolist()
    completion = keep[:, p:].sum(-1).tolist()
    part, offset, lengths = [-1] * len(group), [0] * len(group), []
    for g in sorted(set(x for x, a in zip(group, active) if a)):
        members = [i for i, (x, a) in enumerate(zip(group, active)) if a and x == g]
        for held in segment_parts(prompt[members[0]], [completion[i] for i in members], hidden_size):
            rows = sorted(members[k] for k in held)  # rows in order within a segment
            size = prompt[rows[0]]
            for i in rows:
                part[i], offset[i], size = len(lengths), size - prompt[i], size + completion[i]
            lengths.append(size)
    return SharedParts(keep, part, offset, lengths)


def shared_pays(attention_mask: Tensor, completion_mask: Tensor, input_ids: Tensor, hidden_size: int | None) -> bool:
    """Whether ``pack_shared`` costs less than ``pack`` under ``row_width``'s cost model (dense-masked rows): some
    prompt repeats among rows that train, every such prompt has a token, and the shared layout's modelled cost is
    below the unshared one's."""
    t = completion_mask.shape[1]
    p = input_ids.shape[1] - t
    active = completion_mask.bool().any(-1)
    if p < 1 or not active.any() or not bool(attention_mask[active, p - 1].bool().all()):
        return False
    group, _ = prompt_groups(input_ids, attention_mask, p)
    if len(torch.unique(group[active])) == int(active.sum()):
        return False
    _, lengths = sequence_lengths(attention_mask, completion_mask)
    plain = lengths.tolist()
    unshared = layout_cost(plain, row_width(plain, max(input_ids.shape[1] - 1, 1), hidden_size), hidden_size)
    segments = shared_parts(input_ids, attention_mask, completion_mask, hidden_size).lengths
    shared = layout_cost(segments, row_width(segments, max(segments), hidden_size), hidden_size)
    return shared < unshared


def pack_shared(
    input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, hidden_size: int | None = None
) -> SharedPacked:
    """``input_ids``/``attention_mask`` ``[N, P+T]``, ``completion_mask`` ``[N, T]`` packed with each group's prompt
    once (``SharedPacked``; rows of ``row_width`` over the segments, the widest segment at least).

    A group's rows go into one segment or a few (``segment_parts``: where a wider dense-masked segment would cost
    more than another prompt copy), each with its own prompt copy. A row's kept column ``j`` (``sequence_lengths``) at
    within-sequence index ``w`` (its position id) goes to ``base + w`` in the prompt and ``base + offset + w`` in the
    completion, where ``base`` is its segment's start and ``offset`` the completion tokens of the segment's earlier
    rows. A completion's first token is predicted from the
    prompt's last slot. Needs every training row's prompt non-empty (``shared_pays`` checks).
    """
    device = input_ids.device
    t = completion_mask.shape[1]
    n, total = input_ids.shape
    p = total - t
    parts = shared_parts(input_ids, attention_mask, completion_mask, hidden_size)
    keep, lengths = parts.keep, parts.lengths
    width = row_width(lengths, max(lengths), hidden_size)
    placed = first_fit(lengths, width)
    rows = 1 + max((r for r, _ in placed), default=0)
    starts = [r * width + o for r, o in placed]
    base = torch.tensor([starts[k] if k >= 0 else 0 for k in parts.part], dtype=torch.long, device=device)  # [N]
    offset = torch.tensor(parts.offset, dtype=torch.long, device=device)  # [N]
    within = keep.long().cumsum(-1) - 1  # [N, P+T]: the position id of a kept column
    columns = torch.arange(total, device=device)
    dest = base.unsqueeze(-1) + within + (columns >= p).long() * offset.unsqueeze(-1)  # [N, P+T]
    slots = rows * width
    flat_ids = torch.zeros(slots, dtype=input_ids.dtype, device=device)
    flat_ids[dest[keep]] = input_ids[keep]  # a segment's rows write its prompt's slots with the same ids
    flat_pos = torch.zeros(slots, dtype=torch.long, device=device)
    flat_pos[dest[keep]] = within[keep]
    segment = torch.arange(slots, device=device) + len(lengths)  # tail padding: a segment per slot
    part = torch.tensor(parts.part, dtype=torch.long, device=device)
    segment[dest[keep]] = part.unsqueeze(-1).expand(-1, total)[keep]
    branch = torch.zeros(slots, dtype=torch.long, device=device)
    in_completion = keep & (columns >= p)
    branch[dest[in_completion]] = (torch.arange(n, device=device) + 1).unsqueeze(-1).expand(-1, total)[in_completion]
    hidden_index = dest[:, p - 1 : p + t - 1][completion_mask.bool()]
    view = lambda x: x.view(rows, width)  # noqa: E731
    return SharedPacked(view(flat_ids), view(flat_pos), view(segment), view(branch), hidden_index, sum(lengths))


#: attention implementations that take ``SharedPacked``'s mask (a 4-D tensor, or flex-attention's ``BlockMask``)
SHARED_ATTENTION = ("eager", "sdpa", "flex_attention")


def sharing_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot run ``pack_shared``'s layout, or None: its attention implementation takes no custom
    4-D mask (flash-attention's varlen kernel keeps only whole sequences apart), or a layer attends other than
    causally over everything (sliding windows, chunked attention: the mask would not say so)."""
    impl = attention_implementation(model)
    if impl not in SHARED_ATTENTION:
        return f"attention implementation {impl!r} takes no block mask"
    config = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    # Mistral, Phi-3, Starcoder2: a window whenever ``sliding_window`` is set; Qwen2/3: only with use_sliding_window
    window = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if kinds != {"full_attention"} or window:
        return f"layers of kinds {sorted(kinds)} or a sliding window: the block mask would not hold their windows"
    return None


def shared_attention_mask(model: nn.Module, packed: SharedPacked):
    """``packed.allowed()`` as ``model``'s attention takes it: flex attention a ``BlockMask``, SDPA an additive mask
    (0 where allowed, -inf elsewhere: what SDPA makes of a bool mask, so the same values bit for bit), eager an
    additive one with the embeddings dtype's lowest value. SDPA gets it additive in the embeddings dtype because it
    turns a bool mask into a new float one in every layer's call and saves that for the backward: one ``[R, 1, C,
    C]`` float copy per layer (8 x 0.67 MiB for 3 rows of 242 slots in the throughput benchmark's 8 layers), where
    one float mask is shared by all of them (under autocast in autocast's dtype, which the layers would cast a float32
    one to, each a copy). Every slot sees itself, so no query's row is all -inf."""
    impl = attention_implementation(model)
    if impl == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        segment, branch = packed.segment, packed.branch

        def mask_mod(b, h, q, k):
            own = (branch[b, k] == 0) | (branch[b, k] == branch[b, q])
            return (segment[b, q] == segment[b, k]) & (k <= q) & own

        rows, width = segment.shape
        # compiled off CPU, as transformers builds its own: uncompiled, mask_mod runs over the whole [R, C, C] grid
        # (~10 bytes a pair: 2.7 GB for one 16k-wide row); flex runs on accelerators only (preferred_attention)
        compiled = segment.device.type != "cpu"
        return create_block_mask(mask_mod, rows, None, width, width, device=segment.device, _compile=compiled)
    allowed = packed.allowed()
    dtype = model.get_input_embeddings().weight.dtype
    kind = allowed.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # bf16-mixed: each layer's SDPA
        dtype = torch.get_autocast_dtype(kind)  # cast a float32 mask to a copy of its own, saved for the backward
    blocked = float("-inf") if impl == "sdpa" else torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, blocked)


def shared_layout_tokens(
    input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, hidden_size: int | None = None
) -> tuple[int, int]:
    """``pack_shared``'s tokens (same arguments): real ones (each prompt once per segment) and its rows x width."""
    segments = shared_parts(input_ids, attention_mask, completion_mask, hidden_size).lengths
    if not segments:
        return 0, 0
    width = row_width(segments, max(segments), hidden_size)
    return sum(segments), (1 + max(r for r, _ in first_fit(segments, width))) * width
