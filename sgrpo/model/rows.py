"""Where packed sequences go and what a layout costs: the cost model ``sgrpo.model.packing`` lays rows out by.

Rows are filled first-fit by decreasing length (``first_fit``) at a width a cost model picks (``row_width``): a dense
block-diagonal mask costs attention over a whole row, so wider rows skip more padding in the linear layers but pay
more attention. A shared prompt's completions are cut into segments (``segment_parts``) where another copy of the
prompt costs less than a wider segment. Pure functions of lengths: nothing here sees tensors or models.
"""

from __future__ import annotations

import functools


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
    """The packed rows' width: the one of least cost ``rows x C x (1 + C / (6 hidden_size))`` (per token ~24 H^2
    multiply-adds in the linear layers, per query-key pair ~4 H in a dense-masked attention: the ratio 1 / (6 H));
    W without ``hidden_size``.

    Candidates: the padded forward's ``width`` W, then wider capacities up to one row of every token, on a grid of
    ratio 2^(1/8) and at W x 2^k, each taken at its fill (the fullest row ``first_fit`` makes there: first-fit at
    that capacity places every length as at the wider one, so the same rows cost less; so no layout of capacity
    W x 2^k costs less than the one chosen); W on a tie. The search ends where ``total x (1 + C / (12 H))`` reaches
    the best: no capacity from C up costs less (rows x fill >= total, and the fullest of two or more first-fit rows
    is over half full, else the later row's lengths would have fitted before). A micro-batch asks several times
    (its layout metrics, ``shared_pays``, the packing itself): the answer is remembered.
    """
    return _row_width(tuple(lengths), width, hidden_size)


@functools.lru_cache(maxsize=64)
def _row_width(lengths: tuple[int, ...], width: int, hidden_size: int | None) -> int:
    total, best, best_cost, c = sum(lengths), width, float("inf"), width
    while hidden_size and total * (1 + c / (12 * hidden_size)) < best_cost:
        placed = first_fit(list(lengths), c)
        fill = [0] * (1 + max((r for r, _ in placed), default=0))
        for (r, _), n in zip(placed, lengths):
            fill[r] += n
        taken = width if c == width else max(fill)  # W itself keeps the padded forward's width (bit for bit)
        cost = len(fill) * taken * (1 + taken / (6 * hidden_size))
        if cost < best_cost:
            best, best_cost = taken, cost
        if c >= total:
            break
        doubled = width
        while doubled <= c:  # the next W x 2^k
            doubled *= 2
        c = min(total, max(c + 1, min(int(c * 2**0.125), doubled)))
    return best


def sequence_cost(length: int, hidden_size: int | None) -> float:
    """Modelled cost of one packed sequence of ``length`` tokens: ``L + L^2 / (6 H)`` (per token ~24 H^2
    multiply-adds in the linear layers; per query-key pair ~4 H in attention; in units of a token's linear
    cost). Without ``hidden_size``, ``L``."""
    return length + (length * length / (6 * hidden_size) if hidden_size else 0.0)


def segment_parts(
    prompt: int, completions: list[int], hidden_size: int | None, budget: float | None = None
) -> list[list[int]]:
    """One group's completions (run-token counts) cut into segments ``[prompt, c, c', ...]``, as index lists.

    Greedy, longest completion first: each joins the part where it adds the least ``sequence_cost`` (a dense mask
    makes a segment's attention quadratic in its length), unless a new part with its own prompt copy costs less
    (``sequence_cost(prompt + c)``) or every part would pass ``budget``. Without ``hidden_size``, one part (under
    ``budget``)."""
    cost = lambda n: sequence_cost(n, hidden_size)  # noqa: E731
    parts: list[tuple[list[int], int]] = []
    for i in sorted(range(len(completions)), key=lambda i: -completions[i]):
        c = completions[i]
        fits = [k for k, (_, size) in enumerate(parts) if budget is None or cost(size + c) <= budget]
        best = min(fits, key=lambda k: cost(parts[k][1] + c) - cost(parts[k][1]), default=None)
        if best is None or cost(parts[best][1] + c) - cost(parts[best][1]) >= cost(prompt + c):
            parts.append(([i], prompt + c))
        else:
            parts[best] = (parts[best][0] + [i], parts[best][1] + c)
    return [members for members, _ in parts]


def layout_cost(lengths: list[int], width: int, hidden_size: int | None) -> float:
    """``row_width``'s cost of packing ``lengths`` into rows of ``width``: rows x C x (1 + C / (6 H)); rows x C
    without ``hidden_size``."""
    rows = 1 + max((r for r, _ in first_fit(lengths, width)), default=0)
    return rows * width * (1 + (width / (6 * hidden_size) if hidden_size else 0.0))
