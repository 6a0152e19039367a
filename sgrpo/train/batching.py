"""Cutting an update's rows into micro-batches, and trimming a micro-batch's padding."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sgrpo.model.packing import prompt_groups, sequence_lengths
from sgrpo.model.rows import segment_parts, sequence_cost
from sgrpo.types import RolloutBatch

#: padded tokens per micro-batch under ``micro_batch_tokens="auto"``: small matmuls are already efficient on
#: CPU, accelerators want larger ones
AUTO_MICRO_BATCH_TOKENS = {"cpu": 1024, "accelerator": 8192}


def micro_batches(
    rows: Tensor, lengths: Tensor, prompt_length: int, max_rows: int | None, max_tokens: int | str | None
) -> list[Tensor]:
    """``rows`` ``[R]`` (completion ``lengths`` ``[R]``) cut into micro-batches of similar length, longest first.

    A micro-batch holds at most ``max_rows`` rows and at most ``max_tokens`` padded tokens (rows x
    (``prompt_length`` + its longest completion); "auto": ``AUTO_MICRO_BATCH_TOKENS`` for the rows'
    device), so trimming each one to its longest row (``trim``) drops most padding and activation
    memory stays bounded. A row longer than the budget goes alone. Without either limit, one
    micro-batch in the given order; no rows, none.
    """
    if not len(rows):
        return []
    if max_tokens == "auto":
        max_tokens = AUTO_MICRO_BATCH_TOKENS["cpu" if rows.device.type == "cpu" else "accelerator"]
    if max_rows is None and max_tokens is None:
        return [rows]
    order = lengths.argsort(descending=True, stable=True)
    rows, sorted_lengths = rows[order], lengths[order].tolist()
    max_rows = max_rows or len(rows)
    budget = max_tokens or float("inf")
    chunks, start = [], 0
    for i in range(1, len(rows) + 1):  # a chunk's width is its first (longest) row's
        width = prompt_length + sorted_lengths[start]
        if i == len(rows) or i - start >= max_rows or (i - start + 1) * width > budget:
            chunks.append(rows[start:i])
            start = i
    return chunks


def completion_spans(token_mask: Tensor) -> Tensor:
    """``[R]``: columns of each row's completion region up to its last trained token (0 without one): its loss
    tokens when they are a prefix (single-turn), more where a multi-turn row's observations lie between them."""
    t = token_mask.shape[-1]
    return torch.where(token_mask.any(-1), t - token_mask.flip(-1).int().argmax(-1), 0)


def trim(rollout: RolloutBatch, rows: Tensor, token_mask: Tensor) -> dict[str, Tensor]:
    """The rows' tensors without all-padding columns: left prompt padding and trailing completion padding."""
    ids, attn, mask = rollout.input_ids[rows], rollout.attention_mask[rows], token_mask[rows]
    p = rollout.prompt_length
    first = int(attn[:, :p].any(0).long().argmax()) if p else 0
    t = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1
    return {"input_ids": ids[:, first : p + t], "attention_mask": attn[:, first : p + t], "mask": mask[:, :t]}


def balanced_bins(
    costs: list[float], bins: int, max_rows: int | None = None, sizes: list[int] | None = None
) -> list[list[int]] | None:
    """Indices of ``costs`` in ``bins`` lists of near-equal total cost: longest processing time first (each
    item, costliest first, to the cheapest bin with room for its ``sizes`` rows, one each by default, under
    ``max_rows``; ties to the lower bin). None where an item finds no bin with room (only with ``sizes``: one row
    each fits wherever ``bins * max_rows >= len(costs)``)."""
    sizes = sizes or [1] * len(costs)
    loads, used, members = [0.0] * bins, [0] * bins, [[] for _ in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        open_bins = [b for b in range(bins) if max_rows is None or used[b] + sizes[i] <= max_rows]
        if not open_bins:
            return None
        b = min(open_bins, key=lambda b: (loads[b], b))
        loads[b], used[b] = loads[b] + costs[i], used[b] + sizes[i]
        members[b].append(i)
    return members


def bins_needed(costs: list[float], budget: float | None, max_rows: int | None, sizes: list[int] | None = None) -> int:
    """The fewest bins of ``balanced_bins`` whose every bin costs at most ``budget`` (one item over budget
    goes alone) and holds at most ``max_rows`` rows (``sizes`` rows an item, one by default; none over it); 0 for no
    items."""
    if not costs:
        return 0
    rows = sum(sizes) if sizes else len(costs)
    bins = max(1, -(-rows // max_rows) if max_rows else 1)
    if budget is not None:  # each item over budget alone, the rest at least their total over budget
        over = sum(1 for c in costs if c > budget)
        bins = max(bins, over + int(-(-sum(c for c in costs if c <= budget) // budget)))
    while bins < len(costs) and (budget is not None or sizes is not None):
        members = balanced_bins(costs, bins, max_rows, sizes)
        if members is not None and all(len(b) == 1 or budget is None or sum(costs[i] for i in b) <= budget
                                       for b in members):  # fmt: skip
            break
        bins += 1
    return min(bins, len(costs))


def update_micro_batches(
    rollout: RolloutBatch,
    rows: Tensor,
    token_mask: Tensor,
    packed: bool,
    hidden_size: int | None,
    max_rows: int | None,
    max_tokens: int | str | None,
    agree: Callable[[int], int] = lambda bins: bins,
    share: bool = False,
) -> list[Tensor]:
    """The update's micro-batches of ``rows``. Packed: ``balanced_bins`` of each sequence's modelled cost
    (``sequence_cost``), each under ``max_tokens`` (in those units; "auto": ``AUTO_MICRO_BATCH_TOKENS``), in
    ``agree(bins_needed)`` bins (the most any process needs, so that FSDP2's collectives pair up with even work).
    With ``share`` (packed, each group's prompt once) the items are a group's rows together (``group_parts``; with
    ``max_rows``, parts of at most that many rows, and bins of at most that many rows), so that a prompt runs once
    per part. Padded: rows of similar completion length (``micro_batches``)."""
    if not packed:
        return micro_batches(rows, completion_spans(token_mask[rows]), rollout.prompt_length, max_rows, max_tokens)
    _, lengths = sequence_lengths(rollout.attention_mask[rows], token_mask[rows])
    if max_tokens == "auto":
        max_tokens = AUTO_MICRO_BATCH_TOKENS["cpu" if rows.device.type == "cpu" else "accelerator"]
    chunks, count = None, None
    if share and rollout.prompt_length > 0:
        items = group_parts(rollout, rows, lengths, hidden_size, max_tokens, max_rows)
        costs, sizes = [cost for _, cost in items], [len(members) for members, _ in items]
        count = agree(bins_needed(costs, max_tokens, max_rows, sizes))  # the one agreement of this branch
        bins = balanced_bins(costs, count, max_rows, sizes)
        if bins is not None:
            chunks = [[i for item in b for i in items[item][0]] for b in bins]
    if chunks is None:  # unshared; or (not seen in 20,000 random layouts) parts that fit no agreed count: rows alone
        costs = [sequence_cost(n, hidden_size) for n in lengths.tolist()]
        count = count if count is not None else agree(bins_needed(costs, max_tokens, max_rows))
        chunks = balanced_bins(costs, count, max_rows)  # count >= its rows / max_rows: every row finds a bin
    return [rows[torch.tensor(chunk, dtype=torch.long, device=rows.device)] for chunk in chunks if chunk]


def group_parts(
    rollout: RolloutBatch,
    rows: Tensor,
    lengths: Tensor,
    hidden_size: int | None,
    budget: float | None,
    max_rows: int | None = None,
) -> list[tuple[list[int], float]]:
    """``rows``' groups (one prompt) cut into parts, each a list of indices into ``rows`` and its modelled cost: the
    prompt once plus its rows' completions (``sequence_cost`` of the segment's length). A group's rows go into parts
    by ``sgrpo.model.rows.segment_parts`` under ``budget`` (a row too long for any goes alone with the prompt), and
    a part of more than ``max_rows`` rows into consecutive pieces of at most ``max_rows``.
    """
    p = rollout.prompt_length
    group = prompt_groups(rollout.input_ids[rows], rollout.attention_mask[rows], p)[0].tolist()
    prompt = rollout.attention_mask[rows][:, :p].sum(-1).tolist()
    completion = [max(n - q, 0) for n, q in zip(lengths.tolist(), prompt)]
    parts: list[tuple[list[int], float]] = []
    for g in sorted(set(group)):
        members = [i for i, x in enumerate(group) if x == g]
        for whole in segment_parts(prompt[members[0]], [completion[i] for i in members], hidden_size, budget):
            step = max_rows or len(whole)
            for held in (whole[k : k + step] for k in range(0, len(whole), step)):
                size = prompt[members[0]] + sum(completion[members[k]] for k in held)
                parts.append(([members[k] for k in held], sequence_cost(size, hidden_size)))
    return parts


def group_cost(
    rollout: RolloutBatch, rows: Tensor, token_mask: Tensor, hidden_size: int | None, share: bool,
    max_rows: int | None = None,
) -> float:
    """Modelled update cost of one group's ``rows`` (those with loss tokens): with ``share`` (each group's prompt once
    per part), ``group_parts``' parts without a token budget, of at most ``max_rows`` rows; else each row's
    ``sequence_cost``. What ``model.balance_batch: groups`` balances over processes (``sgrpo.train.exchange``)."""
    rows = rows[token_mask[rows].any(-1).to(rows.device)]
    if not len(rows):
        return 0.0
    _, lengths = sequence_lengths(rollout.attention_mask[rows], token_mask[rows])
    if share and rollout.prompt_length > 0:
        return sum(cost for _, cost in group_parts(rollout, rows, lengths, hidden_size, None, max_rows))
    return sum(sequence_cost(n, hidden_size) for n in lengths.tolist())
