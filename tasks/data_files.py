"""The files of a local task source: which files a folder holds (``data_files``), the split each one holds
(``split_of``), and each file's rows (``read_rows``: jsonl, json, csv, parquet), with where each row is, for
``tasks.data``'s error messages."""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections.abc import Callable, Sequence
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

log = logging.getLogger(__name__)

Row = dict[str, Any]
#: where row i of a file is, for error messages: "line 7", "row 3 (line 10)", "row 3"
Locate = Callable[[int], str]


def read_rows(path: str | Path, columns: Sequence[str] | None = None) -> tuple[list[Row], list[str], Locate]:
    """The rows of one local file (keeping only ``columns``, those present, when given), its columns, and where
    each row is in the file: "line 7" (jsonl), "row 3 (line 10)" (csv), "row 3"."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
            keep = None if columns is None else [c for c in columns if c in names]
            return pq.read_table(path, columns=keep).to_pylist(), names, _row_number
        except Exception as err:  # pyarrow's errors (ArrowInvalid, ...): name the file
            raise ValueError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    if path.suffix == ".csv":
        rows, names, locate = _read_csv(path)
    else:
        rows, locate = _read_json(path)
        names = sorted({key for row in rows for key in row})
    if columns is not None:
        rows = [{k: row[k] for k in columns if k in row} for row in rows]
    return rows, names, locate


def data_files(root: Path, suffixes: Sequence[str] = EXTENSIONS) -> list[Path]:
    """The files of folder ``root`` with one of ``suffixes``, sorted, none under a hidden name (a stale
    ``.ipynb_checkpoints/train-checkpoint.jsonl`` was read as training rows, twice over)."""
    return sorted(p for p in root.rglob("*") if p.suffix in suffixes and not is_hidden(p.relative_to(root)))


def is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def split_of(file: Path, root: Path) -> str:
    """The split a file of the folder ``root`` holds: by its name's first word (``test-00000-of-00001.parquet``),
    else by the nearest folder under ``root`` named as a split (``test/0000.parquet``, the hub's other layout,
    whose test rows were read as training data), else train."""
    return _named_split(file, root) or "train"


def split_files(files: Sequence[Path], root: Path) -> list[str]:
    """``split_of`` each of ``files``; where some name a split and others none (``eval.jsonl`` beside
    ``test.jsonl``: read as train), a warning names the files read as train by default."""
    named = [_named_split(file, root) for file in files]
    unnamed = [f for f, split in zip(files, named, strict=True) if split is None]
    if unnamed and len(unnamed) < len(files):
        log.warning("%s: %s name%s no split, so %s read as training data; name a file after its split "
                    "(validation.jsonl, test-00000.parquet) or put it in a folder named so", root,
                    ", ".join(str(f.relative_to(root)) for f in unnamed), "s"[: len(unnamed) == 1],
                    "it is" if len(unnamed) == 1 else "they are")  # fmt: skip
    return [split or "train" for split in named]


def _named_split(file: Path, root: Path) -> str | None:
    """The split ``file``'s name or nearest folder under ``root`` names, or None."""
    first_word = re.split(r"[-_.]", file.name, maxsplit=1)[0].lower()
    folders = reversed(file.relative_to(root).parent.parts)
    return next((_SPLIT_NAMES[n.lower()] for n in (first_word, *folders) if n.lower() in _SPLIT_NAMES), None)


def _row_number(index: int) -> str:
    return f"row {index + 1}"


def _read_csv(path: Path) -> tuple[list[Row], list[str], Locate]:
    # csv.DictReader, plus the line each record starts on (a quoted field may span lines); a short
    # record lacks its last columns instead of holding None
    rows, starts, header, line = [], [], None, 0
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    for record in reader:
        start, line = line + 1, reader.line_num
        if not record:
            continue
        if header is None:
            header = record
            continue
        rows.append(dict(zip(header, record)))
        starts.append(start)
    return rows, list(header or []), lambda i: f"row {i + 1} (line {starts[i]})"


def _read_text(path: Path) -> str:
    """The file's text (UTF-8, a byte-order mark dropped), or ``ValueError`` naming the file and the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
            f"re-save the file as UTF-8"
        ) from None


def _read_json(path: Path) -> tuple[list[Row], Locate]:
    text = _read_text(path)
    if text.lstrip().startswith("["):
        try:
            rows, locate = json.loads(text), _row_number
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not a JSON array of objects ({err.msg}); fix that line") from None
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{path}, row {index + 1}: expected a JSON object, got {type(row).__name__}")
        return rows, locate
    rows, lines = [], []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 and such are JSON string text
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object per line ({err})") from err
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line, got {type(rows[-1]).__name__}")
            lines.append(number)
    return rows, lambda i: f"line {lines[i]}"


