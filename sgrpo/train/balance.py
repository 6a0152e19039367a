"""Where each of a step's rows or groups trains: an equal-size Karmarkar-Karp partition over data-parallel processes.

The placement of ``model.balance_batch`` (``sgrpo.train.exchange`` moves the rows), as verl 0.6.1's
``RayPPOTrainer._balance_batch`` (``verl/trainer/ppo/ray_trainer.py``, on by default: ``trainer.balance_batch``)
with ``get_seqlen_balanced_partitions`` (``verl/utils/seqlen_balancing.py``) places them; written from their rules:

1. each row's workload is ``24576 L + L^2`` (``verl_workload``), L its real tokens (the attention mask's sum:
   prompt and response), a dense block's FLOPs of a 7B model (hidden 4096) up to a constant;
2. the step's rows (all processes', in global order) are split into ``world`` sets of equal size by the
   largest differencing method (Karmarkar & Karp 1982; ``karmarkar_karp``): the rows sorted by workload are cut
   into k-tuples, each a partial solution of k one-item sets; the partial solution of largest spread (largest set
   sum minus smallest) is merged with the next one, the largest sets of the one with the smallest of the other,
   until one is left. Set i of the final solution (sets in descending order of sum) goes to process i;
3. each set is sorted by (workload, index) and laid out small, ..., large, ..., small (even positions
   ascending, then odd positions descending: ``verl_order``), which verl does "to reduce the bubbles in
   pipeline parallel";
4. the reordered batch is cut into contiguous chunks, one per process; each process then cuts its chunk into
   mini-batches (``ppo_mini_batch_size``) and micro-batches (``ppo_micro_batch_size_per_gpu`` rows) in that order,
   without shuffling (verl's actor ``shuffle: false``). It runs before the reward, the old and the reference
   log-probs and the advantages (those are computed by uid, so the order does not change them).

sgrpo's "groups" mode places whole groups (a prompt's G completions, multi-turn trajectories whole) by the same
partition of the packed cost model's group costs (``sgrpo.train.batching``), groups in ascending order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

#: verl 0.6.1's ``calculate_workload``: 6 x hidden (4096) x L + L^2, proportional to a 7B dense block's FLOPs
VERL_LINEAR = 24576


def verl_workload(length: int) -> int:
    """``24576 L + L^2``: the workload verl balances for a row of ``length`` real tokens."""
    return VERL_LINEAR * length + length * length


class _Set:
    """One set of a partial solution: its sum and its (index, value) items in the order they joined."""

    __slots__ = ("sum", "items")

    def __init__(self, items: list[tuple[int, float]]) -> None:
        self.items = items
        self.sum = sum(v for _, v in items)

    def key(self) -> tuple:
        """Sets compare by sum, then size, then their items (verl's order of sets)."""
        return self.sum, len(self.items), self.items


class _Partial:
    """A partial solution: k sets, kept in descending order of ``_Set.key``; the heap pops the largest spread
    first, ties to the one whose largest set is larger."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[_Set]) -> None:
        self.sets = sorted(sets, key=_Set.key, reverse=True)

    def spread(self) -> float:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _Partial) -> bool:
        if self.spread() != other.spread():
            return self.spread() > other.spread()
        return self.sets[0].key() > other.sets[0].key()

    def absorb(self, other: _Partial) -> None:
        """The largest set of one joins the smallest of the other, and so on down."""
        k = len(self.sets)
        for i in range(k):
            self.sets[i].items = self.sets[i].items + other.sets[k - 1 - i].items
            self.sets[i].sum += other.sets[k - 1 - i].sum
        self.sets = sorted(self.sets, key=_Set.key, reverse=True)


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Indices of ``costs`` in ``k`` sets of near-equal sums by the largest differencing method (module docstring,
    step 2), the sets in descending order of sum, each set's indices in the order they joined.

    ``equal_size``: every set gets ``len(costs) / k`` items (needs ``len(costs) % k == 0``): the items sorted by
    (cost, index) are cut into consecutive k-tuples, each a partial solution of k one-item sets. Otherwise each
    item starts as a partial solution of one set holding it and k - 1 empty ones.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and len(costs) % k:
        raise ValueError(f"equal-size sets need a multiple of k = {k} items, got {len(costs)}")
    ordered = sorted((c, i) for i, c in enumerate(costs))
    heap: list[_Partial] = []
    step = k if equal_size else 1
    for start in range(0, len(ordered), step):
        chunk = [[(i, c)] for c, i in ordered[start : start + step]]
        heapq.heappush(heap, _Partial([_Set(items) for items in chunk + [[]] * (k - len(chunk))]))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    return [[i for i, _ in s.items] for s in heap[0].sets]


def balanced_partitions(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """``karmarkar_karp``'s sets, each sorted by index (verl's ``get_seqlen_balanced_partitions``); refuses an
    empty set."""
    if len(costs) < k:
        raise ValueError(f"{len(costs)} items cannot fill {k} sets")
    sets = [sorted(s) for s in karmarkar_karp(costs, k, equal_size)]
    if any(not s for s in sets):
        raise ValueError("a set came out empty")
    return sets


def verl_order(members: Sequence[int], costs: Sequence[float]) -> list[int]:
    """``members`` sorted by (cost, index), then even positions ascending followed by odd positions descending:
    small items at both ends (module docstring, step 3)."""
    ranked = sorted(members, key=lambda i: (costs[i], i))
    return ranked[::2] + ranked[1::2][::-1]


def place(costs: Sequence[float], world: int, verl_layout: bool) -> list[list[int]]:
    """Each process's indices into ``costs``: an equal-size partition (``balanced_partitions``), the items beyond a
    multiple of ``world`` made up by zero-cost fillers that are then dropped. The fillers come first: they sort
    before the real zero-cost items (ties go by index), so they share the first k-tuple, one per process, and the
    sizes differ by at most one (fillers last could meet in one set beside real zero-cost items, leaving a process
    with nothing). ``verl_layout``: each process's items in ``verl_order``; else ascending."""
    fill = -len(costs) % world
    padded = [0.0] * fill + list(costs)
    sets = balanced_partitions(padded, world, equal_size=True) if len(padded) >= world else [[]] * world
    sets = [[i - fill for i in s if i >= fill] for s in sets]
    return [verl_order(s, costs) if verl_layout else sorted(s) for s in sets]


def imbalance(loads: Sequence[float]) -> float:
    """The largest load over the mean (1: even; 1 for no load)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0
