"""The SoftmaxGRPO paper's held-out split: distinct prompts ranked by a hash of (seed, prompt), the first ones held out.

A prompt that repeats in the source (the same question in several rows) is one item: all its rows fall on one
side, so a held-out question is never also trained on. The ranking depends on the seed and the prompt text
alone, not on the row order or the other rows, so a prompt stays held out when rows are added.
"""

from __future__ import annotations

import hashlib
import json
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


def paper_uid(messages: Sequence[Mapping[str, str]]) -> str:
    """The SoftmaxGRPO authors' id of a prompt: the hex SHA-256 of ``json.dumps(messages, sort_keys=True)`` (UTF-8;
    json's defaults otherwise: ASCII escapes, ", " and ": " separators), ``messages`` the prompt's chat messages
    (``[system, user]``, or ``[user]`` for a task without a system message), each a ``{"role", "content"}`` dict."""
    return hashlib.sha256(json.dumps(list(messages), sort_keys=True).encode()).hexdigest()


def paper_holdout(rows: Sequence[Row], uid: Callable[[Row], str], size: int, seed: int) -> dict[str, list[Row]]:
    """The authors' ``grouped_split``: ``rows`` split into "train" and "validation" by prompt id (``paper_uid``).

    The n distinct ids are ranked by the raw SHA-256 digest of ``f"{seed}:{uid}"`` (UTF-8) and the first
    min(``size``, max(1, n // 10)) held out; every row of a held-out id goes to validation. Rows keep the source's
    order. Raises ``ValueError`` for fewer than two distinct prompts or a ``size`` that is not a count >= 1.

    Countdown, its GOLD variant and OpenThoughts as the paper holds them out: ``size`` 500, ``seed`` 42; DeepMath
    1,000.
    """
    require(isinstance(size, int) and not isinstance(size, bool) and size >= 1,
            f"validation_size must be a count >= 1 with the paper's holdout, got {size!r}")  # fmt: skip
    ids = [uid(row) for row in rows]
    distinct = set(ids)
    require(len(distinct) >= 2, f"the paper's holdout needs two distinct prompts or more, got {len(distinct)}")
    ranked = sorted(distinct, key=lambda key: hashlib.sha256(f"{seed}:{key}".encode()).digest())
    held = set(ranked[: min(size, max(1, len(distinct) // 10))])
    out: dict[str, list[Row]] = {"train": [], "validation": []}
    for row, key in zip(rows, ids, strict=True):
        out["validation" if key in held else "train"].append(row)
    return out


def check_holdout(holdout: str, validation_size: int | float, test_size: int | float) -> None:
    """A task's ``holdout`` and sizes, checked at construction: "hash" (sgrpo's ``hash_holdout``) or "paper" (the
    authors' ``paper_holdout``: one validation split of ``validation_size`` prompts, a count, and no test split)."""
    require(holdout in ("hash", "paper"), f"holdout must be 'hash' or 'paper', got {holdout!r}")
    if holdout == "paper":
        whole = isinstance(validation_size, int) and not isinstance(validation_size, bool)
        require(whole and validation_size >= 1, f"validation_size must be a count >= 1 with holdout: paper (the "
                f"authors hold out a number of prompts), got {validation_size!r}")  # fmt: skip
        require(not test_size, f"test_size must be 0 with holdout: paper (the authors hold out a validation split "
                f"only), got {test_size!r}")  # fmt: skip


def prompt_uid(system_prompt: str | None, user: str) -> str:
    """``paper_uid`` of the chat prompt ``[system, user]`` (``[user]`` without a system message)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return paper_uid([*system, {"role": "user", "content": user}])


class PaperCarver:
    """The ``carve`` of a ``tasks.data.SplitTable`` that holds validation out by ``paper_holdout`` with ``uid``; a
    lazy table carves by ``digest`` and ``counts`` (``ranked_split``), selecting the same rows."""

    def __init__(self, uid: Callable[[Row], str]) -> None:
        self.uid = uid

    def __call__(self, rows: list[Row], sizes: dict[str, int | float], seed: int) -> dict[str, list[Row]]:
        return paper_holdout(rows, self.uid, sizes["validation"], seed)

    def digest(self, row: Row, seed: int) -> bytes:
        """The row's rank: the SHA-256 digest of ``f"{seed}:{uid}"``."""
        return hashlib.sha256(f"{seed}:{self.uid(row)}".encode()).digest()

    def counts(self, n: int, sizes: Mapping[str, int | float]) -> list[tuple[str, int]]:
        size = sizes["validation"]
        require(isinstance(size, int) and not isinstance(size, bool) and size >= 1,
                f"validation_size must be a count >= 1 with the paper's holdout, got {size!r}")  # fmt: skip
        require(n >= 2, f"the paper's holdout needs two distinct prompts or more, got {n}")
        return [("validation", min(size, max(1, n // 10)))]


def paper_carver(uid: Callable[[Row], str]) -> PaperCarver:
    """The ``carve`` of a ``tasks.data.SplitTable`` that holds validation out by ``paper_holdout`` with ``uid``."""
    return PaperCarver(uid)


class HashRanking:
    """``hash_holdout`` by ``digest`` and ``counts`` (``ranked_split``), for a lazy table: the same rows."""

    def __init__(self, prompt: Callable[[Row], str]) -> None:
        self.prompt = prompt

    def digest(self, row: Row, seed: int) -> bytes:
        """The digest whose hex is ``rank_key(seed, prompt)`` (hex and bytes sort alike)."""
        return hashlib.sha256(f"{seed}\n{self.prompt(row)}".encode()).digest()

    def counts(self, n: int, sizes: Mapping[str, int | float]) -> list[tuple[str, int]]:
        out = []
        for split, size in sizes.items():
            check_size(size, f"{split}_size")
            out.append((split, held_out_prompts(size, n)))
        return out


def ranked_split(digests, counts: list[tuple[str, int]] | Callable[[int], list[tuple[str, int]]]) -> dict:
    """Positions per split of rows with rank ``digests`` (``numpy`` ``S32``, one per row): the distinct digests in
    ascending order, the first ``count`` to the first split of ``counts`` (a list, or a function of the number of
    distinct digests), the next to the next, the rest to "train"; every row of a digest where the digest goes.
    Positions ascend (the source's order) in each split. ``paper_holdout`` and ``hash_holdout`` without the rows."""
    import numpy as np

    distinct, inverse = np.unique(digests, return_inverse=True)
    counts = counts(len(distinct)) if callable(counts) else counts
    side = np.full(len(distinct), -1, dtype=np.int64)
    start = 0
    for number, (_, count) in enumerate(counts):
        side[start : start + count] = number
        start += count
    of_row = side[inverse.reshape(-1)]
    return {"train": np.flatnonzero(of_row == -1)} | {
        split: np.flatnonzero(of_row == number) for number, (split, _) in enumerate(counts)
    }
