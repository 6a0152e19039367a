"""Reading task data: a local file (jsonl, json, csv, parquet), a local folder of split files, or a hub id.

A source's own splits are used as they are (hub splits; in a folder, files named after their split
such as ``train-00000-of-00001.parquet`` or ``test.json``; a single file is a "train" split). A split
the source lacks is carved from its train rows with a fixed seed, so splits are deterministic and
disjoint. ``datasets.load_dataset`` is used for hub ids only; local files need no network.

Every row is checked when the source is read against the task's ``Schema`` (columns it must have, and
checks on their values, such as a non-blank answer); a bad row of a local file raises ``ValueError``
naming the file, the row (the line of a jsonl file; 1-based) and the column, with a hint on the fix.
Hub rows whose values fail a check are dropped with a warning (a hub copy cannot be edited); a hub
dataset that lacks a column still raises.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.data_files import _SPLIT_NAMES, EXTENSIONS, Locate, Row, data_files, read_rows, split_files
from tasks.holdout import check_size, hash_holdout

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

log = logging.getLogger(__name__)

#: a check on one value: "" if it is fine, else what is wrong with it ("is empty")
Check = Callable[[Any], str]


def is_blank(value: Any) -> bool:
    """None, NaN, or an empty / whitespace-only string or an empty list."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    if isinstance(value, str):
        return not value.strip()
    return isinstance(value, (list, tuple, dict)) and not value


def not_blank(value: Any) -> str:
    """The ``Check`` of a text column that must hold something (a question, an answer, a reference).

    A value that is not a string (a number, a list, an object) is refused rather than turned into
    its ``str``: ``42`` and ``"42"`` may both be meant, ``["a", "b"]`` is a broken row.
    """
    if is_blank(value):
        return f"is empty ({value!r})"
    if not isinstance(value, str):
        return f"is not text ({type(value).__name__} {str(value)[:80]!r}); write it as a string"
    return ""


def number_or_blank(value: Any) -> str:
    """The ``Check`` of an optional numeric column (a difficulty rating)."""
    if is_blank(value):
        return ""
    try:
        float(value)
    except (TypeError, ValueError):
        return f"is not a number ({value!r})"
    return ""


@dataclass(frozen=True)
class Schema:
    """What every row of a source needs: the ``required`` columns, and ``checks`` on column values.

    ``name`` (e.g. "the DeepMath schema") and ``hint`` (how to fix a source that lacks a column, e.g.
    "set reference_field=") go into error messages.
    """

    required: tuple[str, ...]
    checks: Mapping[str, Check] = field(default_factory=dict)
    name: str = ""
    hint: str = ""

    def describe(self) -> str:
        columns = ", ".join(self.required)
        return f"{self.name} ({columns})" if self.name else f"the columns {columns}"


def check_rows(
    rows: list[Row],
    names: Sequence[str],
    schemas: Sequence[Schema],
    source: str,
    locate: Locate,
    drop: bool = False,
    dropped_to: list[str] | None = None,
) -> list[Row]:
    """``rows`` of ``source`` if they all fit its schema, else ``ValueError`` at the first that does not.

    The schema is the first of ``schemas`` whose required columns are all among ``names`` (the source's
    columns), else the closest one, so the error names a column the source lacks. With ``drop`` (hub
    data, which the user cannot edit) rows whose values fail a check are dropped with a warning instead, or, given
    ``dropped_to``, their messages appended there (a caller checking a source batch by batch warns once).
    """
    if not schemas:
        return rows
    present = set(names)
    schema = max(schemas, key=lambda s: (set(s.required) <= present, len(present & set(s.required))))
    expected = " or ".join(s.describe() for s in schemas)
    kept, dropped = [], []
    for index, row in enumerate(rows):
        for column in schema.required:
            if column not in row:
                where = f"{source}, {locate(index)}, column {column!r}"
                if column in present:
                    raise ValueError(f"{where}: missing in this row (other rows have it); add it or remove the row")
                hint = f"; {schema.hint}" if schema.hint else ""
                raise ValueError(
                    f"{where}: missing; the source has columns {sorted(present)}; expected {expected}{hint}"
                )
        problems = [(column, check(row[column])) for column, check in schema.checks.items() if column in row]
        problem = next(((column, text) for column, text in problems if text), None)
        if problem is None:
            kept.append(row)
            continue
        message = f"{source}, {locate(index)}, column {problem[0]!r}: {problem[1]}"
        if not drop:
            raise ValueError(f"{message}; fix or remove that row")
        dropped.append(message)
    if dropped_to is not None:
        dropped_to.extend(dropped)
    elif dropped:
        warn_dropped(dropped, len(rows))
    return kept


def warn_dropped(dropped: list[str], rows: int) -> None:
    if dropped:
        log.warning("dropped %d of %d rows that fail the checks; the first: %s", len(dropped), rows, dropped[0])


def held_out_count(size: int | float, n: int) -> int:
    """Rows to hold out of ``n``: a count as is; a fraction rounded, at least 1 when > 0."""
    return size if isinstance(size, int) else (max(1, round(size * n)) if size > 0 else 0)


def check_source(path: str, field: str = "path") -> str:
    """Classify ``path`` as "file", "dir" or "hub", or raise a clear error. A path that is not there but names a
    local folder (``./``, ``/``, ``~``, ``data/``, or a first part that exists here: ``data/openthoughts`` before
    ``sgrpo.prepare_data`` ran, or on a node without ``data/``) is refused as missing, not looked up on the hub."""
    p = Path(path).expanduser()
    if p.is_dir():
        return "dir"
    if p.is_file():
        if not path.endswith(EXTENSIONS):
            raise ValueError(f"{field}={path!r}: unsupported file type; use one of {', '.join(EXTENSIONS)}")
        return "file"
    first = Path(path).parts[:1]  # data/: sgrpo.prepare_data's folder, on a fresh checkout not there yet either
    local = path.startswith((".", "/", "~")) or first == ("data",) or first and Path(first[0]).is_dir()
    if local and not p.exists():
        raise FileNotFoundError(
            f"{field}={path!r} does not exist (looked from {Path.cwd()}); if it is a data set sgrpo prepares, run "
            f"python -m sgrpo.prepare_data (--only NAME) from there first, else give a hub id"
        )
    if _HUB_ID.fullmatch(path) and not path.endswith(EXTENSIONS):
        return "hub"
    raise FileNotFoundError(
        f"{field}={path!r} does not exist; give a local {'/'.join(EXTENSIONS)} file, a folder of split "
        f"files, or a hub id such as 'owner/name'"
    )


class SplitTable:
    """Rows per split of one source, read on first use; missing splits carved from train by ``seed``.

    ``sizes`` maps "validation" / "test" to the rows held out of train when the source lacks that
    split (a count, or a fraction of the train rows). ``columns`` are kept (those present).
    Every row must fit ``schema`` (one ``Schema``, or alternatives: each file is held to the one it
    fits); a bad row of a file raises ``ValueError`` naming the file, the row and the column (a hub row
    with a bad value is dropped with a warning). Carved rows come in a seeded random order; the train
    rows left keep the source's order. ``group`` (a row's prompt) carves by ``tasks.holdout.hash_holdout``
    instead; ``carve(train_rows, sizes, seed)`` (the missing splits' sizes) by a rule of its own (the paper's
    ``tasks.holdout.paper_holdout``).
    """

    def __init__(
        self,
        path: str,
        config: str | None = None,
        columns: Sequence[str] | None = None,
        schema: Schema | Sequence[Schema] = (),
        sizes: Mapping[str, int | float] | None = None,
        seed: int = 0,
        field: str = "path",
        group: Callable[[Row], str] | None = None,
        carve: Callable[[list[Row], dict[str, int | float], int], dict[str, list[Row]]] | None = None,
    ) -> None:
        self.kind = check_source(path, field)
        self.group, self.carve = group, carve
        self.path, self.config, self.columns, self.seed, self.field = path, config, columns, seed, field
        self.schemas: list[Schema] = [schema] if isinstance(schema, Schema) else list(schema)
        self.sizes = dict(sizes or {})
        for split, size in self.sizes.items():
            check_size(size, f"{split}_size")
        self._rows: dict[str, list[Row]] | None = None

    def splits(self) -> list[str]:
        """The splits this table has (native or carved); reads the source on first use."""
        if self._rows is None:
            self._rows = self._carve(self._read_native())
        return sorted(self._rows)

    def rows(self, split: str) -> list[Row]:
        """The rows of ``split``; raises if the source lacks it and no size is set to carve it."""
        if split not in self.splits():
            if split == "train":  # an evaluation source (a folder holding test.jsonl) has no train rows
                raise ValueError(f"{self.path!r} has no train split (found {sorted(self._rows)}); give a source with "
                                 f"train rows (a file named train*, or a single file)")  # fmt: skip
            raise ValueError(
                f"{self.path!r} has no {split!r} split (it has {sorted(self._rows)}) and {split}_size is "
                f"{self.sizes.get(split, 0)!r}: set {split}_size to hold out rows of train, or use a source with "
                f"that split"
            )
        return self._rows[split]

    def _read(self, file: str | Path) -> list[Row]:
        rows, names, locate = read_rows(file, self.columns)
        if not rows:
            raise ValueError(f"{file} holds no rows; give {self.field}= a file with data")
        return check_rows(rows, names, self.schemas, str(file), locate)

    def _read_native(self) -> dict[str, list[Row]]:
        if self.kind == "file":
            return {"train": self._read(self.path)}
        if self.kind == "dir":
            return self._read_dir()
        return self._read_hub()

    def _read_dir(self) -> dict[str, list[Row]]:
        root = Path(self.path).expanduser()
        files = data_files(root)
        if not files:
            raise FileNotFoundError(f"{self.path!r} holds no {'/'.join(EXTENSIONS)} files")
        by_split: dict[str, list[Row]] = {}
        for file, split in zip(files, split_files(files, root), strict=True):
            by_split.setdefault(split, []).extend(self._read(file))
        return by_split

    def _read_hub(self) -> dict[str, list[Row]]:
        import datasets  # imported here: slow, and only hub ids need it

        out = {}
        for name in datasets.get_dataset_split_names(self.path, self.config):
            split = _SPLIT_NAMES.get(name)
            if split is None or split in out:
                continue
            data = datasets.load_dataset(self.path, self.config, split=name)
            names = data.column_names
            if self.columns is not None:
                data = data.select_columns([c for c in self.columns if c in names])
            locate = lambda i, name=name: f"split {name!r} row {i + 1}"  # noqa: E731
            out[split] = check_rows(data.to_list(), names, self.schemas, self.path, locate, drop=True)
        return out

    def _carve(self, native: dict[str, list[Row]]) -> dict[str, list[Row]]:
        missing = [s for s in ("test", "validation") if s not in native and self.sizes.get(s)]
        if not missing:  # a source of test rows only (AIME 2025's test.jsonl) is read as it is
            return native
        if "train" not in native:
            raise ValueError(f"{self.path!r} has no train split to hold {', '.join(missing)} out of (found "
                             f"{sorted(native)})")  # fmt: skip
        train = native["train"]
        sizes = {s: self.sizes[s] for s in ("validation", "test") if s in missing}  # validation: the first ranks
        if self.carve is not None:
            return native | self.carve(train, sizes, self.seed)
        if self.group is not None:
            return native | hash_holdout(train, self.group, sizes, self.seed)
        for split, positions in self.random_positions(len(train), missing).items():
            native[split] = [train[i] for i in positions]
        return native

    def random_positions(self, n: int, missing: list[str]) -> dict[str, list[int]]:
        """The positions of the ``missing`` splits' rows among ``n`` train rows, held out at random by ``seed`` (in
        the shuffled order), and of the train rows left (ascending)."""
        order = list(range(n))
        random.Random(self.seed).shuffle(order)
        start, out = 0, {}
        for split in missing:
            count = held_out_count(self.sizes[split], n)
            out[split] = order[start : start + count]
            start += count
        if start >= n:
            sizes = ", ".join(f"{s}_size={self.sizes[s]!r}" for s in missing)
            raise ValueError(f"{sizes} hold out {start} of the {n} rows of {self.path!r}; lower them")
        return out | {"train": sorted(order[start:])}
