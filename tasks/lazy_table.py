"""``LazySplitTable``: a ``SplitTable`` whose parquet or hub rows stay memory-mapped (``tasks.arrow_rows``).

Its splits are ``ArrowRows`` (positions into one memory-mapped Arrow copy per split), checked and carved as a
``SplitTable`` checks and carves them, the same rows in the same order: the paper's holdout and the hash holdout by
``tasks.holdout.ranked_split`` over one digest per row, the random holdout by ``SplitTable.random_positions``.
A source that is not parquet (jsonl, json, csv: local files a user writes, small) is read as a ``SplitTable``
reads it, into lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tasks.arrow_rows import ArrowRows, open_hub, open_parquet, scan
from tasks.data import SplitTable, check_rows, warn_dropped
from tasks.data_files import _SPLIT_NAMES, Row, _row_number, data_files, split_files, split_of
from tasks.holdout import HashRanking, ranked_split


class LazySplitTable(SplitTable):
    """A ``SplitTable`` (same arguments) that keeps a parquet file, a folder of parquet files or a hub data set in
    a memory-mapped Arrow copy: ``rows(split)`` is an ``ArrowRows``, each row read when used.

    OpenThoughts3 (1.2M rows) and DeepMath-103K (with its three R1 solutions) are read this way, so a process
    holds row positions (8 bytes a row), not rows."""

    def splits(self) -> list[str]:
        if self._rows is None and self.is_lazy():
            self._rows = self._lazy_splits()
        return super().splits()

    def is_lazy(self) -> bool:
        """Whether the source is read lazily: a hub id, a parquet file, or a folder of parquet files only."""
        if self.kind == "hub":
            return True
        if self.kind == "file":
            return self.path.endswith(".parquet")
        files = data_files(Path(self.path).expanduser())
        return bool(files) and all(p.suffix == ".parquet" for p in files)

    def _ranking(self):
        """How train is carved: an object with ``digest(row, seed)`` and ``counts(n, sizes)``, or None (random)."""
        if self.carve is not None:
            if not hasattr(self.carve, "digest"):
                raise TypeError(f"a lazy table carves by digest; {self.carve!r} has none (use tasks.holdout's)")
            return self.carve
        return HashRanking(self.group) if self.group is not None else None

    def _lazy_splits(self) -> dict[str, ArrowRows]:
        segments: dict[str, list[tuple]] = {}  # split -> [(dataset, columns, source, locate, drop)], one a file
        if self.kind == "hub":
            import datasets

            for name in datasets.get_dataset_split_names(self.path, self.config):
                split = _SPLIT_NAMES.get(name)
                if split is None or split in segments:
                    continue
                dataset, names = open_hub(self.path, self.config, name, self.columns)
                locate = lambda i, name=name: f"split {name!r} row {i + 1}"  # noqa: E731
                segments[split] = [(dataset, names, self.path, locate, True)]
        else:
            path = Path(self.path).expanduser()
            files = [path] if self.kind == "file" else data_files(path, (".parquet",))
            splits = [split_of(path, path)] if self.kind == "file" else split_files(files, path)
            for file, split in zip(files, splits, strict=True):
                dataset, names = open_parquet(file, self.columns)
                segments.setdefault(split, []).append((dataset, names, str(file), _row_number, False))
        missing = [s for s in ("test", "validation") if s not in segments and self.sizes.get(s)]
        if "train" not in segments and missing:  # a source of test rows only is read as it is (SplitTable's rule)
            raise ValueError(f"{self.path!r} has no train split to hold {', '.join(missing)} out of (found "
                             f"{sorted(segments)})")  # fmt: skip
        ranking = self._ranking() if missing else None
        out, train_digests = {}, None
        for split, parts in segments.items():
            digest = (lambda row: ranking.digest(row, self.seed)) if split == "train" and ranking else None
            out[split], digests = self._scan(parts, digest)
            train_digests = digests if split == "train" else train_digests
        if not missing:
            return out
        train = out["train"]
        sizes = {s: self.sizes[s] for s in ("validation", "test") if s in missing}  # validation: the first ranks
        if ranking is not None:
            carved = ranked_split(train_digests, lambda n: ranking.counts(n, sizes))
        else:
            carved = self.random_positions(len(train), missing)
        return out | {split: train.take(positions) for split, positions in carved.items()}

    def _scan(self, parts: list[tuple], digest) -> tuple[ArrowRows, np.ndarray | None]:
        """The rows of one split's files, checked (``check_rows``), with their digests; a file without rows raises."""
        import datasets

        positions, digests, offset = [], [], 0
        for dataset, names, source, locate, drop in parts:
            if not len(dataset) and not drop:
                raise ValueError(f"{source} holds no rows; give {self.field}= a file with data")
            dropped: list[str] = []  # one warning for the source, not one per batch of rows
            kept, these = scan(dataset, self._checker(names, source, locate, drop, dropped), digest)
            warn_dropped(dropped, len(dataset))
            positions.append(offset + kept)
            digests.append(these)
            offset += len(dataset)
        whole = parts[0][0] if len(parts) == 1 else self._concatenated(datasets, parts)
        joined = None if digest is None else np.concatenate(digests)
        return ArrowRows(whole, np.concatenate(positions)), joined

    def _concatenated(self, datasets, parts: list[tuple]):
        """One dataset of the parts' (memory-mapped, not copied); files that disagree on a column's type (int64 in
        one shard, double in another) are refused naming the column, two of the files and the fix: datasets' own
        error named neither file."""
        try:
            return datasets.concatenate_datasets([part[0] for part in parts])
        except ValueError:
            types: dict[str, dict[str, str]] = {}
            for dataset, _, source, _, _ in parts:
                for name, feature in dataset.features.items():
                    types.setdefault(name, {}).setdefault(str(feature), source)
            column, seen = next(((n, t) for n, t in types.items() if len(t) > 1), (None, {}))
            if column is None:
                raise
            (first, a), (second, b) = list(seen.items())[:2]
            raise ValueError(
                f"{self.field}={self.path!r}: its files disagree on column {column!r}'s type ({a}: {first}; {b}: "
                f"{second}); write every file with one type for it (pyarrow: table.cast), the lazy table maps them "
                f"as they are"
            ) from None

    def _checker(self, names: Sequence[str], source: str, locate, drop: bool,
                 dropped: list[str]) -> Callable[[list[Row], int], list[int]]:  # fmt: skip
        def check(rows: list[Row], first: int) -> list[int]:
            kept = check_rows(rows, names, self.schemas, source, lambda i: locate(first + i), drop, dropped)
            if len(kept) == len(rows):
                return list(range(len(rows)))
            ids = {id(row) for row in kept}
            return [i for i, row in enumerate(rows) if id(row) in ids]

        return check

