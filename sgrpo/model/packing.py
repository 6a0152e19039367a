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

Rows are filled first-fit by decreasing length. Their width is the padded forward's (W) or a multiple
(``row_width``): a dense block-diagonal mask costs attention over the whole row, so wider rows skip
more padding in the linear layers but pay more attention; a cost model picks. At width W each token's
attention reduces over as many keys as in the padded path, so the per-token results are the padded
path's bit for bit where the kernels allow (eager and SDPA on CPU, float32); wider rows sum in
another order (float32: ~1e-7 apart). A flash-attention model gets one row (its varlen kernel costs
the sum of each sequence's own square).

``sgrpo.model.logprobs.packing_problem`` says why a model cannot pack, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

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
    keep = attention_mask.bool() & (columns < stop.unsqueeze(-1))
    return keep, keep.sum(-1)


def first_fit(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """(row, offset) of each length, first-fit by decreasing length into rows of ``capacity`` (>= the longest)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    room: list[int] = []
    placed = [(0, 0)] * len(lengths)
    for i in order:
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), len(room))
        if row == len(room):
            room.append(capacity)
        placed[i] = (row, capacity - room[row])
        room[row] -= lengths[i]
    return placed


def row_width(lengths: list[int], width: int, hidden_size: int | None) -> int:
    """The packed rows' width: the padded forward's ``width`` W, or 2W, 4W, ... (up to one row of every token),
    whichever costs least under ``rows x C x (1 + C / (6 hidden_size))`` (per token ~24 H^2 multiply-adds in
    the linear layers, per query-key pair ~4 H in a dense-masked attention: the ratio 1 / (6 H)); W on a
    tie, and W without ``hidden_size``."""
    total, best, best_cost, c = sum(lengths), width, float("inf"), width
    while hidden_size:
        rows = 1 + max((r for r, _ in first_fit(lengths, c)), default=0)
        cost = rows * c * (1 + c / (6 * hidden_size))
        if cost < best_cost:
            best, best_cost = c, cost
        if c >= total:
            break
        c *= 2
    return best


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
