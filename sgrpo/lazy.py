"""Sequences that build their items when read: a task's rows stay in their memory-mapped file, not in every process.

``Mapped(base, fn)`` is ``fn`` over ``base`` (rows -> ``Example`` s), ``take(seq, positions)`` the items at
``positions`` of any sequence: a list for a list, the same kind of lazy sequence for a lazy one (a
``Mapped`` of a ``tasks.arrow_rows.ArrowRows``), so a filter or a limit over 1.2M rows copies positions, never
rows. ``fn`` must pickle (a module-level function or a ``functools.partial`` of one): the asynchronous producer's
process receives the training stream at spawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any


def is_lazy(seq: Sequence) -> bool:
    """Whether ``seq`` builds its items when read (anything but a list or a tuple)."""
    return not isinstance(seq, (list, tuple))


def take(seq: Sequence, positions: Sequence[int]) -> Sequence:
    """The items of ``seq`` at ``positions``, in that order: a list for a list or a tuple, else ``seq.take``'s lazy
    view when it has one (``Mapped``, ``ArrowRows``), else a list."""
    if is_lazy(seq) and hasattr(seq, "take"):
        return seq.take(positions)
    return [seq[int(i)] for i in positions]


class Mapped(Sequence):
    """``fn(base[i])`` for each i, computed when read; ``take`` and slices stay lazy (over ``base``'s ``take``)."""

    def __init__(self, base: Sequence, fn: Callable[[Any], Any]) -> None:
        self.base, self.fn = base, fn

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        return self.fn(self.base[index])

    def __iter__(self) -> Iterator:
        return map(self.fn, self.base)  # the base's own iteration (ArrowRows reads in batches)

    def take(self, positions: Sequence[int]) -> Mapped:
        return Mapped(take(self.base, positions), self.fn)

    def __repr__(self) -> str:
        return f"Mapped({len(self)} items of {type(self.base).__name__})"
