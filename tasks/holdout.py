"""The SoftmaxGRPO paper's held-out split: distinct prompts ranked by a hash of (seed, prompt), the first ones held out.

A prompt that repeats in the source (the same question in several rows) is one item: all its rows fall on one
side, so a held-out question is never also trained on. The ranking depends on the seed and the prompt text
alone, not on the row order or the other rows, so a prompt stays held out when rows are added.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from sgrpo.checks import require

Row = TypeVar("Row")

def check_size(value: int | float, field: str) -> None:
    """A held-out size is a count (int >= 0) or a fraction (float in [0, 1))."""
    ok = value >= 0 if isinstance(value, int) else 0.0 <= value < 1.0
    require(
        ok and not isinstance(value, bool),
        f"{field} must be a count (int >= 0) or a fraction (float in [0, 1)), got {value!r}",
    )


#: at most this share of the distinct prompts is held out per split
MAX_SHARE = 0.1


def rank_key(seed: int, prompt: str) -> str:
    """The hex SHA-256 of ``f"{seed}\\n{prompt}"`` (UTF-8): prompts are held out in ascending order of it."""
    return hashlib.sha256(f"{seed}\n{prompt}".encode()).hexdigest()


def held_out_prompts(size: int | float, n: int) -> int:
    """How many of ``n`` distinct prompts a split of ``size`` holds out: min(size, floor(MAX_SHARE x n)) for a
    count, min(round(size x n), floor(MAX_SHARE x n)) for a fraction."""
    wanted = size if isinstance(size, int) else round(size * n)
    return min(wanted, int(MAX_SHARE * n))


def hash_holdout(
    rows: Sequence[Row], prompt: Callable[[Row], str], sizes: Mapping[str, int | float], seed: int
) -> dict[str, list[Row]]:
    """``rows`` split into "train" and the held-out ``sizes`` (split -> a count or a fraction of the distinct
    prompts, in the order given): the distinct ``prompt(row)`` values ranked by ``rank_key(seed, prompt)``; each
    split takes the next ``held_out_prompts`` of them, and every row of a prompt goes where its prompt goes.
    Rows keep the source's order within each split.

    DeepMath as the paper holds it out: ``hash_holdout(rows, question, {"validation": 1000}, seed=42)``.
    """
    keys = [prompt(row) for row in rows]
    ranked = sorted(set(keys), key=lambda p: rank_key(seed, p))
    side: dict[str, str] = {}
    start = 0
    for split, size in sizes.items():
        check_size(size, f"{split}_size")
        count = held_out_prompts(size, len(ranked))
        side |= dict.fromkeys(ranked[start : start + count], split)
        start += count
    out: dict[str, list[Row]] = {"train": [], **{split: [] for split in sizes}}
    for row, key in zip(rows, keys, strict=True):
        out[side.get(key, "train")].append(row)
    return out
