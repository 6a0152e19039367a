"""The resumable prompt streams of training, one item per training step: endless (``StepBatches``, for a run
bounded by ``trainer.max_steps``), or in epochs (``EpochStepBatches``, for ``trainer.max_epochs``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from sgrpo.checks import ConfigError
from sgrpo.types import Example


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (FNV-1a style), e.g. (seed, step, rank)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def stopping_rule_error(max_steps: object, max_epochs: object) -> str | None:
    """Why ``trainer.max_steps`` and ``trainer.max_epochs`` do not bound a run, in one line, or None when they do:
    a step count >= 1, or an epoch count >= 1 with ``max_steps`` -1 or unset (the stream is endless otherwise)."""
    unset = (None, -1)
    for key, value in (("max_steps", max_steps), ("max_epochs", max_epochs)):
        if value not in unset and not (isinstance(value, int) and value >= 1):
            return f"trainer.{key} must be >= 1, or -1 / unset for no limit, got {value!r}"
    if max_steps in unset and max_epochs in unset:
        return ("set trainer.max_steps (training steps) or trainer.max_epochs (passes over the train split's "
                "distinct prompts, with max_steps -1): neither bounds the run")  # fmt: skip
    return None


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
    ``position % world_size == rank``. A step that spans two epochs takes the end of one and the start of
    the next: the next epoch's permutation then starts with prompts that end did not hold (the others keep
    their order), so that no step holds a prompt twice (where B <= N). The stream is a pure function of
    (seed, step), so resuming at a step continues exactly where an uninterrupted run would be.

    ``start_step``: where an iteration starts, a step (the first iteration; each later one goes on after the last
    step the one before yielded) or a function read as each iteration starts (the policy's steps done). Lightning
    starts an iteration per epoch and stops one early under ``trainer.limit_train_batches`` (and pulls a batch
    ahead of the one it trains), so only the policy's count says which step comes next: an iteration that
    restarted at the first step trained the first steps' prompts again, epoch after epoch.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        prompts_per_step: int,
        seed: int,
        start_step: int | Callable[[], int] = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not examples:
            raise ConfigError(
                "the task's train split is empty: give it rows (its num_train, train_size or data file), or evaluate "
                "without training (python -m sgrpo.fit validate)"
            )
        self.examples = examples
        self.prompts_per_step, self.seed = prompts_per_step, seed
        self._cursor = start_step if callable(start_step) else None
        self.next_step = 0 if callable(start_step) else start_step  # without a cursor: where the next iteration starts
        self.rank, self.world_size = rank, world_size
        self._perms: dict[int, torch.Tensor] = {}  # newest epochs' orders, as int64 (a list of ints: 40 bytes a row)

    def _raw(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s seeded permutation of the positions in ``examples``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.examples), generator=generator, device="cpu")

    def _spans(self) -> bool:
        """Whether a step can span two epochs and hold a prompt twice by the raw orders (B <= N, B not dividing N):
        only then does an epoch's order depend on the one before."""
        n, b = len(self.examples), self.prompts_per_step
        return b <= n and n % b != 0

    #: positions of epoch orders kept (int64: 8 MiB), in at most ``KEPT_EPOCHS`` epochs and at least the two a spanning
    #: step reads: readers some epochs apart (an async producer's look-ahead beside the loader) find theirs without a
    #: rebuild of the chain from epoch 0
    KEPT_POSITIONS, KEPT_EPOCHS = 1 << 20, 64

    def _perm(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order (``_raw``, else ``_after`` each epoch before it, from the newest one kept before it
        or from epoch 0); the newest ``KEPT_POSITIONS // N`` epochs (2 to ``KEPT_EPOCHS``) are kept, and the one asked
        for."""
        if epoch in self._perms:
            return self._perms[epoch]
        keep = min(self.KEPT_EPOCHS, max(2, self.KEPT_POSITIONS // len(self.examples)))
        if not self._spans():
            self._perms[epoch] = self._raw(epoch)
        else:
            start = max((e for e in self._perms if e < epoch), default=None)
            e, order = (start, self._perms[start]) if start is not None else (0, self._raw(0))
            self._perms[e] = order
            while e < epoch:
                e, order = e + 1, self._after(e + 1, order)
                self._perms[e] = order
                self._perms.pop(e - keep, None)  # a long walk (a resume) holds no more than it keeps
        newest = max(self._perms)
        self._perms = {e: o for e, o in self._perms.items() if e > newest - keep or e == epoch}
        return self._perms[epoch]

    def _after(self, epoch: int, before: torch.Tensor) -> torch.Tensor:
        """Epoch ``epoch``'s order after ``before``, the epoch before's: its ``_raw`` permutation, where a step spans
        the two epochs with the prompts that step took from ``before``'s end moved past the step's part of it."""
        order, n, b = self._raw(epoch), len(self.examples), self.prompts_per_step
        head = -(epoch * n) % b  # the spanning step's positions in this epoch (0: no step spans the two)
        if head == 0:
            return order
        taken = torch.zeros(n, dtype=torch.bool, device="cpu")
        taken[before[n - (b - head) :]] = True
        first = order[~taken[order]][:head]
        rest = torch.ones(n, dtype=torch.bool, device="cpu")
        rest[first] = False
        return torch.cat([first, order[rest[order]]])

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.examples))
        return int(self._perm(epoch)[offset])

    def indices(self, step: int) -> list[int]:
        """The positions in ``examples`` of training step ``step``'s prompts, every process's, in the step's order."""
        first = step * self.prompts_per_step
        return [self._index(p) for p in range(first, first + self.prompts_per_step)]

    def batch(self, step: int) -> list[Example]:
        """This process's prompts of training step ``step``: its share of ``indices(step)``."""
        return [self.examples[i] for i in self.indices(step)[self.rank :: self.world_size]]

    def __getstate__(self) -> dict:
        """A copy for another process (an async producer reads ``batch``) goes without the cursor: a function of
        this process's policy, which the copy neither has nor iterates by."""
        return {**self.__dict__, "_cursor": None, "next_step": self.first_step()}

    def first_step(self) -> int:
        """The step the next iteration starts at (``start_step``)."""
        return self._cursor() if self._cursor is not None else self.next_step

    def __iter__(self) -> Iterator[list[Example]]:
        step = self.first_step()
        while True:
            self.next_step = step + 1
            yield self.batch(step)
            step += 1


class EpochStepBatches(StepBatches):
    """``StepBatches`` in epochs: epoch e is ``steps_per_epoch = ceil(N / B)`` steps over epoch e's permutation
    of the N prompts, B at a time, the last step of an epoch completed by the epoch's first prompts
    (``ceil(N / B) * B - N`` of them seen twice), so that every distinct prompt is trained on once per epoch and
    every process takes as many steps. Step s takes the epoch offsets ``(s mod S) * B .. + B - 1``, mod N.

    Lightning's epoch is one iteration: it yields the steps from ``first_step()`` (a resumed run's step, mid-epoch
    or not) to the end of that step's epoch. ``len()`` is an epoch's steps before any limit (Lightning applies its
    own ``limit_train_batches`` to it); ``steps_per_epoch`` the steps it then runs an epoch.

    ``limit_batches``: ``trainer.limit_train_batches`` (an int counts steps, a float is a fraction of them,
    ``limited_batches``): S is then the steps Lightning runs an epoch, epoch e steps ``e * S ..`` over the first
    ``S * B`` prompts of its permutation, so that an epoch cut short by the limit does not leave its rest to the next.
    """

    def __init__(self, examples: Sequence[Example], prompts_per_step: int, seed: int,
                 start_step: int | Callable[[], int] = 0, rank: int = 0, world_size: int = 1,
                 limit_batches: int | float | None = None) -> None:  # fmt: skip
        super().__init__(examples, prompts_per_step, seed, start_step, rank, world_size)
        self.full_epoch = math.ceil(len(examples) / prompts_per_step)
        # at least 1 (a limit of 0 runs no epoch's loop): the step -> epoch arithmetic divides by it
        self.steps_per_epoch = max(1, limited_batches(self.full_epoch, limit_batches))

    def __len__(self) -> int:
        return self.full_epoch  # Lightning applies trainer.limit_train_batches to it itself (to steps_per_epoch)

    def _spans(self) -> bool:
        return False  # an epoch's last step is completed by its own first prompts

    def indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        first, n = within * self.prompts_per_step, len(self.examples)
        return [self._index(epoch * n + offset % n) for offset in range(first, first + self.prompts_per_step)]

    def __iter__(self) -> Iterator[list[Example]]:
        start = self.first_step()
        for step in range(start, (start // self.steps_per_epoch + 1) * self.steps_per_epoch):
            self.next_step = step + 1
            yield self.batch(step)


def limited_batches(batches: int, limit: int | float | None) -> int:
    """How many of ``batches`` Lightning runs under ``limit`` (a ``limit_*_batches``): an int counts batches, a float
    is a fraction of them (rounded down, as Lightning does)."""
    if limit is None or isinstance(limit, bool):
        return batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


class RefillStream:
    """Dynamic sampling's refill prompts, drawn from the prompts a step has not drawn yet.

    Round r (>= 1) of step s takes positions ``(r-1)*B .. r*B-1`` of step s's refill order: a seeded permutation
    of the prompts that neither ``stream``'s step s (every process's share) nor its earlier rounds drew, so that a
    step never holds a prompt twice (an independent stream redrew the step's prompts, those just dropped as
    constant too). Once the step has drawn every prompt, further rounds read fresh permutations of them all (a
    data set smaller than the step's rounds repeats prompts, as it did). Process ``rank`` takes the positions
    ``position % world_size == rank``. A pure function of (seed, step, round) and ``stream``: a resumed run draws
    the same, and no state is checkpointed.
    """

    def __init__(self, stream: StepBatches, seed: int) -> None:
        self.stream, self.seed = stream, seed
        self._order: tuple[int, list[torch.Tensor]] = (-1, [])  # the last step's refill order so far, as int64

    def _permutation(self, step: int, part: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, 1, step, part))  # 1: the refills' salt
        return torch.randperm(len(self.stream.examples), generator=generator, device="cpu")

    def batch(self, step: int, sampling_round: int) -> list[Example]:
        """This process's prompts of refill round ``sampling_round`` (>= 1) of training step ``step``."""
        b, n = self.stream.prompts_per_step, len(self.stream.examples)
        if self._order[0] != step:
            fresh = torch.ones(n, dtype=torch.bool, device="cpu")
            fresh[torch.tensor(self.stream.indices(step), dtype=torch.int64, device="cpu")] = False
            order = self._permutation(step, 0)
            self._order = (step, [order[fresh[order]]])
        parts = self._order[1]
        while sum(len(part) for part in parts) < sampling_round * b:  # every prompt drawn: n more (n >= 1)
            parts.append(self._permutation(step, len(parts)))
        order = torch.cat(parts)
        first = (sampling_round - 1) * b
        positions = range(first + self.stream.rank, first + b, self.stream.world_size)
        return [self.stream.examples[int(order[p])] for p in positions]
