"""Cutting an update's rows into micro-batches, and trimming a micro-batch's padding."""

from __future__ import annotations

from torch import Tensor

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


def trim(rollout: RolloutBatch, rows: Tensor, token_mask: Tensor) -> dict[str, Tensor]:
    """The rows' tensors without all-padding columns: left prompt padding and trailing completion padding."""
    ids, attn, mask = rollout.input_ids[rows], rollout.attention_mask[rows], token_mask[rows]
    p = rollout.prompt_length
    first = int(attn[:, :p].any(0).long().argmax()) if p else 0
    t = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1
    return {"input_ids": ids[:, first : p + t], "attention_mask": attn[:, first : p + t], "mask": mask[:, :t]}
