"""A large source read lazily: a memory-mapped Arrow copy (``datasets``), positions per split, rows read when used.

OpenThoughts3 has 1.2M rows whose reasoning traces take tens of GB: each process of a run must not hold them. A
parquet file (or folder, or hub data set) is converted once per machine into ``datasets``' Arrow cache (its
``Dataset.from_parquet`` / ``load_dataset``: under a file lock, so the processes of one machine convert once and
the others wait), which every process memory-maps: the pages are the operating system's page cache, shared by
the processes and dropped under pressure, not the processes' own memory. One pass in batches checks every row
against the task's schema (the same errors as an eager read, naming the file and the row) and computes each row's
holdout digest (``tasks.holdout.ranked_split``); a split is then an array of row positions (``ArrowRows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: rows per batch of the checking pass and of ``ArrowRows`` iteration
BATCH = 512

Row = dict[str, Any]


class ArrowRows(Sequence):
    """Rows of a memory-mapped ``datasets.Dataset`` at ``positions`` (all rows by default), each read when used."""

    def __init__(self, dataset, positions: np.ndarray | None = None) -> None:
        self.dataset = dataset
        self.positions = np.arange(len(dataset), dtype=np.int64) if positions is None else positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        return self.dataset[int(self.positions[index])]

    def __iter__(self) -> Iterator[Row]:
        arrow = self.dataset.with_format("arrow")
        for start in range(0, len(self.positions), BATCH):
            yield from arrow[self.positions[start : start + BATCH].tolist()].to_pylist()

    def take(self, positions: Sequence[int]) -> ArrowRows:
        return ArrowRows(self.dataset, self.positions[np.asarray(positions, dtype=np.int64)])

    def __repr__(self) -> str:
        return f"ArrowRows({len(self)} of {len(self.dataset)} rows)"


def open_parquet(file: Path, columns: Sequence[str] | None) -> tuple[Any, list[str]]:
    """The memory-mapped dataset of one parquet ``file`` (``columns`` kept, those present; with none of them, the
    file's first column, so that the row check names the missing ones) and the file's columns. A file without rows,
    or one ``datasets`` cannot read past its schema, raises ``ValueError`` naming it."""
    import datasets  # slow to import: only lazy tables need it
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(file)
    except Exception as err:  # pyarrow's errors (ArrowInvalid, ...): name the file
        raise ValueError(f"{file}: not a readable parquet file ({type(err).__name__}: {err})") from None
    names = metadata.schema.to_arrow_schema().names
    if metadata.num_rows == 0:  # datasets' own error (DatasetGenerationError) named neither the file nor the cause
        raise ValueError(f"{file} holds no rows; give a file with data")
    keep = None if columns is None else [c for c in columns if c in names] or names[:1]
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one bar a file would flood the log
    try:
        dataset = datasets.Dataset.from_parquet(str(file), columns=keep)
    except datasets.exceptions.DatasetGenerationError as err:
        raise ValueError(f"{file}: not a readable parquet file ({err.__cause__ or err})") from None
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    release_memory()
    return dataset, list(names)


def release_memory() -> None:
    """Hand the memory freed after a conversion or a scan back to the system: pyarrow's pool and glibc's heap keep
    freed blocks otherwise (tens of MB after reading a few row groups, counted as the process's own)."""
    import contextlib
    import ctypes

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def open_hub(path: str, config: str | None, split: str, columns: Sequence[str] | None) -> tuple[Any, list[str]]:
    """A hub split as ``datasets`` caches it (memory-mapped), ``columns`` kept (those present), and its columns."""
    import datasets

    dataset = datasets.load_dataset(path, config, split=split)
    names = list(dataset.column_names)
    if columns is not None:
        dataset = dataset.select_columns([c for c in columns if c in names])
    return dataset, names


def scan(
    dataset, check: Callable[[list[Row], int], list[int]], digest: Callable[[Row], bytes] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """One pass over ``dataset`` in batches: ``check(rows, first)`` gives the positions (within the batch) of the
    rows to keep (it raises at a bad row, or drops it); returns the kept rows' positions and, with ``digest``, the
    kept rows' 32-byte digests (``numpy`` ``S32``), in row order."""
    kept: list[np.ndarray] = []
    digests = bytearray()
    first = 0
    for table in dataset.with_format("arrow").iter(batch_size=BATCH):
        rows = table.to_pylist()
        keep = check(rows, first)
        kept.append(first + np.asarray(keep, dtype=np.int64))
        if digest is not None:
            for i in keep:
                digests += digest(rows[i])
        first += len(rows)
    release_memory()
    positions = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    return positions, (np.frombuffer(bytes(digests), dtype="S32") if digest is not None else None)
