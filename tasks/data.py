"""Reading task data: a local file (jsonl, json, csv, parquet), a local folder of split files, or a hub id.

A source's own splits are used as they are (hub splits; in a folder, files named after their split
such as ``train-00000-of-00001.parquet`` or ``test.json``; a single file is a "train" split). A split
the source lacks is carved from its train rows with a fixed seed, so splits are deterministic and
disjoint. ``datasets.load_dataset`` is used for hub ids only; local files need no network.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
_SPLIT_NAMES = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
}
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

Row = dict[str, Any]


def check_size(value: int | float, field: str) -> None:
    """A held-out size is a count (int >= 0) or a fraction (float in [0, 1))."""
    ok = value >= 0 if isinstance(value, int) else 0.0 <= value < 1.0
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{field} must be a count (int >= 0) or a fraction (float in [0, 1)), got {value!r}")


def held_out_count(size: int | float, n: int) -> int:
    """Rows to hold out of ``n``: a count as is; a fraction rounded, at least 1 when > 0."""
    return size if isinstance(size, int) else (max(1, round(size * n)) if size > 0 else 0)


def check_source(path: str, field: str = "path") -> str:
    """Classify ``path`` as "file", "dir" or "hub", or raise a clear error."""
    p = Path(path).expanduser()
    if p.is_dir():
        return "dir"
    if p.is_file():
        if not path.endswith(EXTENSIONS):
            raise ValueError(f"{field}={path!r}: unsupported file type; use one of {', '.join(EXTENSIONS)}")
        return "file"
    if _HUB_ID.fullmatch(path) and not path.endswith(EXTENSIONS):
        return "hub"
    raise FileNotFoundError(
        f"{field}={path!r} does not exist; give a local {'/'.join(EXTENSIONS)} file, a folder of split "
        f"files, or a hub id such as 'owner/name'"
    )


def read_file(path: str | Path, columns: Sequence[str] | None = None) -> tuple[list[Row], list[str]]:
    """The rows of one local file (keeping only ``columns``, those present, when given) and its columns."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        keep = None if columns is None else [c for c in columns if c in names]
        return pq.read_table(path, columns=keep).to_pylist(), names
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows, names = list(reader), list(reader.fieldnames or [])
    else:
        rows = _read_json(path)
        names = sorted({key for row in rows for key in row})
    if columns is not None:
        rows = [{k: row[k] for k in columns if k in row} for row in rows]
    return rows, names


def _read_json(path: Path) -> list[Row]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object per line ({err})") from err
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: expected JSON objects (one per line, or a list of them)")
    return rows


class SplitTable:
    """Rows per split of one source, read on first use; missing splits carved from train by ``seed``.

    ``sizes`` maps "validation" / "test" to the rows held out of train when the source lacks that
    split (a count, or a fraction of the train rows). ``columns`` are kept (those present);
    every row must have the ``required`` ones. Carved rows come in a seeded random order; the
    train rows left keep the source's order.
    """

    def __init__(
        self,
        path: str,
        config: str | None = None,
        columns: Sequence[str] | None = None,
        required: Sequence[str] = (),
        sizes: Mapping[str, int | float] | None = None,
        seed: int = 0,
        field: str = "path",
    ) -> None:
        self.kind = check_source(path, field)
        self.path, self.config, self.columns, self.required, self.seed = path, config, columns, required, seed
        self.source_columns: list[str] = []  # every column of the source, known once it is read
        self.sizes = dict(sizes or {})
        for split, size in self.sizes.items():
            check_size(size, f"{split}_size")
        self._rows: dict[str, list[Row]] | None = None

    def splits(self) -> list[str]:
        """The splits this table has (native or carved); reads the source on first use."""
        if self._rows is None:
            self._rows = self._carve(self._checked(self._read_native()))
        return sorted(self._rows)

    def rows(self, split: str) -> list[Row]:
        """The rows of ``split``; raises if the source lacks it and no size is set to carve it."""
        if split not in self.splits():
            raise ValueError(
                f"{self.path!r} has no {split!r} split (it has {sorted(self._rows)}); set {split}_size "
                f"to hold out rows of train, or use a source with that split"
            )
        return self._rows[split]

    def _checked(self, native: dict[str, list[Row]]) -> dict[str, list[Row]]:
        for split, rows in native.items():
            for index, row in enumerate(rows):
                missing = [c for c in self.required if c not in row]
                if missing:
                    raise ValueError(
                        f"{self.path!r} ({split} row {index}) lacks column(s) {missing}; the source has "
                        f"{self.source_columns}; expected {list(self.required)}"
                    )
        return native

    def _read(self, file: str | Path) -> list[Row]:
        rows, names = read_file(file, self.columns)
        self.source_columns = sorted(set(self.source_columns) | set(names))
        return rows

    def _read_native(self) -> dict[str, list[Row]]:
        if self.kind == "file":
            return {"train": self._read(self.path)}
        if self.kind == "dir":
            return self._read_dir()
        return self._read_hub()

    def _read_dir(self) -> dict[str, list[Row]]:
        files = sorted(p for p in Path(self.path).expanduser().rglob("*") if p.suffix in EXTENSIONS)
        if not files:
            raise FileNotFoundError(f"{self.path!r} holds no {'/'.join(EXTENSIONS)} files")
        by_split: dict[str, list[Row]] = {}
        for file in files:
            stem = re.split(r"[-_.]", file.name, maxsplit=1)[0].lower()
            by_split.setdefault(_SPLIT_NAMES.get(stem, "train"), []).extend(self._read(file))
        return by_split

    def _read_hub(self) -> dict[str, list[Row]]:
        import datasets  # imported here: slow, and only hub ids need it

        out = {}
        for name in datasets.get_dataset_split_names(self.path, self.config):
            split = _SPLIT_NAMES.get(name)
            if split is None or split in out:
                continue
            data = datasets.load_dataset(self.path, self.config, split=name)
            self.source_columns = sorted(set(self.source_columns) | set(data.column_names))
            if self.columns is not None:
                data = data.select_columns([c for c in self.columns if c in data.column_names])
            out[split] = data.to_list()
        return out

    def _carve(self, native: dict[str, list[Row]]) -> dict[str, list[Row]]:
        if "train" not in native:
            raise ValueError(f"{self.path!r} has no train split (found {sorted(native)})")
        train = native["train"]
        missing = [s for s in ("test", "validation") if s not in native and self.sizes.get(s)]
        if not missing:
            return native
        order = list(range(len(train)))
        random.Random(self.seed).shuffle(order)
        start = 0
        for split in missing:
            count = held_out_count(self.sizes[split], len(train))
            native[split] = [train[i] for i in order[start : start + count]]
            start += count
        if start >= len(train):
            sizes = ", ".join(f"{s}_size={self.sizes[s]!r}" for s in missing)
            raise ValueError(f"{sizes} hold out {start} of the {len(train)} rows of {self.path!r}; lower them")
        native["train"] = [train[i] for i in sorted(order[start:])]
        return native
