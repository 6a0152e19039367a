"""The endless, resumable prompt stream of training: one item per training step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from sgrpo.types import Example


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (FNV-1a style), e.g. (seed, step, rank)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class PromptBatch:
    """A loader's batch of prompts (a list of ``Example``, or of (index, ``Example``) for evaluation), opaque to
    Lightning on its way to the step.

    Lightning hands every batch to the precision plugin's ``convert_input`` before any hook: under ``bf16-true``,
    ``16-true`` or ``64-true`` it walks the batch and rebuilds each dataclass it meets, which fails on the
    frozen ``Example`` (such runs stopped at step 1) and would copy every prompt each step. The policy's
    ``on_before_batch_transfer`` unwraps it.
    """

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items


def prompt_collate(batch: list) -> PromptBatch:
    """The loaders' ``collate_fn``: the batch as it is, wrapped (``PromptBatch``)."""
    return PromptBatch(batch)


class StepBatches(IterableDataset):
    """Yields this process's share of the prompts of each training step, from step ``start_step`` on.

    The global order is a fresh seeded permutation of ``examples`` per epoch, read ``prompts_per_step``
    at a time; step s takes global positions ``s*B .. s*B+B-1`` and process ``rank`` the ones with
    ``position % world_size == rank``. The stream is a pure function of (seed, step), so resuming
    at a step continues exactly where an uninterrupted run would be.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        prompts_per_step: int,
        seed: int,
        start_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not examples:
            raise ValueError("the task's train split is empty")
        self.examples = examples
        self.prompts_per_step, self.seed, self.start_step = prompts_per_step, seed, start_step
        self.rank, self.world_size = rank, world_size
        self._perms: dict[int, list[int]] = {}

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.examples))
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.examples), generator=generator, device="cpu").tolist()}
        return self._perms[epoch][offset]

    def batch(self, step: int) -> list[Example]:
        """This process's prompts of training step ``step``."""
        first = step * self.prompts_per_step
        positions = range(first + self.rank, first + self.prompts_per_step, self.world_size)
        return [self.examples[self._index(p)] for p in positions]

    def __iter__(self) -> Iterator[list[Example]]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1
