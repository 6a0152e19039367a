"""Every file-based loader fails at load on a row that lacks a column or has an empty answer, naming the
file, the row (the line of a jsonl file, 1-based) and the column, with a hint on the fix."""

import csv
import json
import re
from pathlib import Path

import pytest

from tasks import GSM8K, DeepMath, MeetingBank, PoetryClassification, PoetryWriting, ReferenceText
from tasks.data import SplitTable, check_rows, check_source
from tasks.data_files import read_rows
from tasks.deepmath import SCHEMAS
from tasks.gsm8k import SCHEMA as GSM8K_SCHEMA

FIXTURES = Path(__file__).parent / "fixtures"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


DEEPMATH = [{k: r[k] for k in ("question", "final_answer", "difficulty", "topic")} for r in _rows("deepmath.jsonl")]
TRL = _rows("deepmath_trl_test.jsonl")
GSM = _rows("gsm8k.jsonl")
POEMS = _rows("poetry.jsonl")
MEETINGS = _rows("meetingbank.jsonl")
PAIRS = [{"prompt": f"say {w}", "reference": w} for w in ("red", "green", "blue")]


def _edit(rows: list[dict], index: int, **changes) -> list[dict]:
    """A copy of ``rows`` with row ``index`` changed; a change to ``None`` drops the column."""
    rows = [dict(r) for r in rows]
    for key, value in changes.items():
        if value is None:
            rows[index].pop(key)
        else:
            rows[index][key] = value
    return rows


def _write(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(POEMS[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:  # jsonl, with a blank line after the first row: locations are file lines, not row indices
        lines = [json.dumps(r) for r in rows]
        path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")


def _deepmath(path):
    return DeepMath(path=path, validation_size=0)


def _poetry_type(path):
    return PoetryClassification(path=path, validation_size=0, test_size=0)


def _poetry_age(path):
    return PoetryClassification(path=path, label="age", validation_size=0, test_size=0)


def _poetry_writing(path):
    return PoetryWriting(path=path, validation_size=0, test_size=0)


def _meetingbank(path):
    return MeetingBank(path=path)


def _reference(path):
    return ReferenceText(path, validation_size=0, test_size=0)


def _gsm8k(path):
    return GSM8K(path=path, validation_size=0)


# (id, task factory, file name, rows, location in the message, column, words of the message)
CASES = [
    ("deepmath-missing", _deepmath, "dm.jsonl", _edit(DEEPMATH, 2, final_answer=None), "line 4", "final_answer",
     "missing in this row"),
    ("deepmath-blank", _deepmath, "dm.jsonl", _edit(DEEPMATH, 1, final_answer="   "), "line 3", "final_answer",
     "is empty"),
    ("deepmath-null", _deepmath, "dm.jsonl", _edit(DEEPMATH, 0, final_answer=[]), "line 1", "final_answer",
     "is empty"),
    ("deepmath-no-column", _deepmath, "dm.jsonl", [{"problem": "1+1", "answer": "2"}], "line 1", "question",
     "expected the DeepMath schema (question, final_answer) or the trl-lib schema (prompt, solution)"),
    ("deepmath-difficulty", _deepmath, "dm.jsonl", _edit(DEEPMATH, 4, difficulty="hard"), "line 6", "difficulty",
     "is not a number"),
    ("deepmath-parquet", _deepmath, "dm.parquet", _edit(DEEPMATH, 3, final_answer=""), "row 4", "final_answer",
     "is empty"),
    ("deepmath-json-list", _deepmath, "dm.json", _edit(DEEPMATH, 1, question=None), "row 2", "question",
     "missing in this row"),
    ("trl-missing", _deepmath, "trl.jsonl", _edit(TRL, 1, solution=None), "line 3", "solution",
     "missing in this row"),
    ("trl-blank", _deepmath, "trl.jsonl", _edit(TRL, 2, solution="\n"), "line 4", "solution", "is empty"),
    ("trl-no-user", _deepmath, "trl.jsonl", _edit(TRL, 0, prompt=[{"role": "system", "content": "hi"}]), "line 1",
     "prompt", "holds no user message"),
    ("gsm8k-missing", _gsm8k, "gsm.jsonl", _edit(GSM, 1, answer=None), "line 3", "answer", "missing in this row"),
    ("gsm8k-no-hashes", _gsm8k, "gsm.jsonl", _edit(GSM, 0, answer="It is 27."), "line 1", "answer",
     "has no final '#### <number>' line"),
    ("gsm8k-empty-after", _gsm8k, "gsm.jsonl", _edit(GSM, 2, answer="So.\n####  "), "line 4", "answer",
     "has no number after '####'"),
    ("poetry-type-blank", _poetry_type, "poems.csv", _edit(POEMS, 2, type=" "), "row 3 (line 10)", "type",
     "is empty"),
    ("poetry-age-blank", _poetry_age, "poems.csv", _edit(POEMS, 1, age=""), "row 2 (line 6)", "age", "is empty"),
    ("poetry-content-blank", _poetry_writing, "poems.jsonl", _edit(POEMS, 3, content=""), "line 5", "content",
     "is empty"),
    ("poetry-missing", _poetry_writing, "poems.jsonl", _edit(POEMS, 4, author=None), "line 6", "author",
     "missing in this row"),
    ("meetingbank-missing", _meetingbank, "mb.jsonl", _edit(MEETINGS, 3, summary=None), "line 5", "summary",
     "missing in this row"),
    ("meetingbank-blank", _meetingbank, "mb.jsonl", _edit(MEETINGS, 0, summary="\t"), "line 1", "summary",
     "is empty"),
    ("reference-blank", _reference, "pairs.jsonl", _edit(PAIRS, 2, reference=" "), "line 4", "reference",
     "is empty"),
    ("reference-no-column", _reference, "pairs.jsonl", [{"prompt": "x", "answer": "y"}], "line 1", "reference",
     "set prompt_field= and reference_field="),
    ("deepmath-list-question", _deepmath, "dm.jsonl", _edit(DEEPMATH, 1, question=["1+1", "2+2"]), "line 3",
     "question", "is not text (list"),
    ("deepmath-dict-question", _deepmath, "dm.json", _edit(DEEPMATH, 2, question={"text": "1+1"}), "row 3",
     "question", "is not text (dict"),
    ("deepmath-int-answer", _deepmath, "dm.jsonl", _edit(DEEPMATH, 0, final_answer=42), "line 1", "final_answer",
     "is not text (int '42')"),
    ("reference-dict-prompt", _reference, "pairs.jsonl", _edit(PAIRS, 2, prompt={"say": "blue"}), "line 4",
     "prompt", "is not text (dict"),
]  # fmt: skip


@pytest.mark.parametrize(("factory", "name", "rows", "where", "column", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_a_bad_row_fails_at_load_naming_file_row_and_column(tmp_path, factory, name, rows, where, column, words):
    path = tmp_path / name
    _write(path, rows)
    task = factory(str(path))  # reading is lazy: the first split asked for loads the file
    with pytest.raises(ValueError) as info:
        task.examples("train")
    message = str(info.value)
    assert message.startswith(f"{path}, {where}, column {column!r}: "), message
    assert words in message
    assert re.search(r"(fix or remove that row|add it or remove the row|expected )", message)


def test_the_fixtures_pass_and_csv_rows_know_their_lines():
    rows, names, locate = read_rows(FIXTURES / "poetry.csv")
    assert len(rows) == 5 and names == list(POEMS[0])
    assert [locate(i) for i in range(3)] == ["row 1 (line 2)", "row 2 (line 6)", "row 3 (line 10)"]  # 4-line poems
    for factory, name in [(_deepmath, "deepmath.jsonl"), (_deepmath, "deepmath_trl_test.jsonl"),
                          (_gsm8k, "gsm8k.jsonl"), (_poetry_type, "poetry.csv"), (_poetry_writing, "poetry.jsonl"),
                          (_meetingbank, "meetingbank.jsonl")]:  # fmt: skip
        assert factory(str(FIXTURES / name)).examples("train")


def test_a_short_csv_record_lacks_its_last_columns(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text('author,content,poem name,age,type\nA,"x\ny",T,Modern,Love\nB,z,U\n')
    with pytest.raises(ValueError, match=r"short.csv, row 2 \(line 4\), column 'age': missing in this row"):
        _poetry_type(str(path)).examples("train")


def test_a_test_path_file_is_checked_too(tmp_path):
    path = tmp_path / "test.jsonl"
    _write(path, _edit(TRL, 1, solution=""))
    task = DeepMath(path=str(FIXTURES / "deepmath.jsonl"), validation_size=1, test_path=str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 3, column 'solution': is empty")):
        task.examples("test")


def test_a_folder_names_the_bad_file(tmp_path):
    _write(tmp_path / "train.jsonl", GSM[:3])
    _write(tmp_path / "test.jsonl", _edit(GSM[3:], 1, answer="#### 12 apples"))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'test.jsonl'}, line 3, column 'answer': has no")):
        SplitTable(str(tmp_path), schema=GSM8K_SCHEMA).splits()


def test_hub_rows_with_bad_values_are_dropped_with_a_warning(caplog):
    rows = _edit(DEEPMATH, 1, final_answer="")
    rows[3]["final_answer"] = None  # an Arrow null
    locate = lambda i: f"split 'train' row {i + 1}"  # noqa: E731
    kept = check_rows(rows, list(DEEPMATH[0]), SCHEMAS, "owner/name", locate, drop=True)
    assert [r["question"] for r in kept] == [DEEPMATH[i]["question"] for i in (0, 2, 4)]
    assert "dropped 2 of 5 rows" in caplog.text
    assert "the first: owner/name, split 'train' row 2, column 'final_answer': is empty" in caplog.text
    with pytest.raises(ValueError, match="owner/name, split 'train' row 1, column 'question': missing; the source"):
        check_rows([{"problem": "x"}], ["problem"], SCHEMAS, "owner/name", locate, drop=True)  # no column: raises


@pytest.mark.parametrize(("name", "data", "where"), [
    ("pairs.jsonl", b'{"prompt": "say red", "reference": "red"}\n{"prompt": "caf\xe9", "reference": "x"}\n', ":2:"),
    ("pairs.csv", b"prompt,reference\nsay red,red\n\ncaf\xe9,x\n", ":4:"),
])  # fmt: skip
def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path, name, data, where):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"{path}{where} not UTF-8 text (byte 0xe9")):
        _reference(str(path)).examples("train")


def test_an_empty_file_says_it_holds_no_rows(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=re.escape(f"{path} holds no rows; give path= a file with data")):
        _reference(str(path)).examples("train")


def test_split_folders_hold_their_splits(tmp_path):
    """The hub's other layout, ``train/0000.parquet`` and ``test/0000.parquet``: the split by the folder (a split
    by the file name's first word alone read the test rows as training data)."""
    for split, rows in (("train", GSM[:3]), ("test", GSM[3:])):
        (tmp_path / "data" / split).mkdir(parents=True)
        _write(tmp_path / "data" / split / "0000.parquet", rows)
    _write(tmp_path / "data" / "validation-00000-of-00001.parquet", GSM[:1])  # a file's own name still decides
    table = SplitTable(str(tmp_path / "data"), schema=GSM8K_SCHEMA)
    assert {split: len(table.rows(split)) for split in table.splits()} == {"train": 3, "test": len(GSM) - 3,
                                                                           "validation": 1}  # fmt: skip


def test_hidden_files_of_a_folder_are_not_data(tmp_path):
    """A stale ``.ipynb_checkpoints/train-checkpoint.jsonl`` was read as training rows (each row twice), and a
    ``test-checkpoint.jsonl`` there as test rows; the resume's content fingerprint skips hidden files too."""
    folder = tmp_path / "data"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    lines = "".join(json.dumps(row) + "\n" for row in GSM)
    (folder / "train.jsonl").write_text(lines)
    (folder / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text(lines)
    (folder / ".ipynb_checkpoints" / "test-checkpoint.jsonl").write_text(lines)
    table = SplitTable(str(folder), schema=GSM8K_SCHEMA)
    assert table.splits() == ["train"] and len(table.rows("train")) == len(GSM)


def test_a_file_that_names_no_split_beside_ones_that_do_is_named_as_read_as_train(tmp_path, caplog):
    """``eval.jsonl`` beside ``train.jsonl`` and ``test.jsonl`` was read as training rows without a word."""
    lines = "".join(json.dumps(row) + "\n" for row in GSM)
    for name in ("train.jsonl", "test.jsonl", "eval.jsonl"):
        (tmp_path / "data" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "data" / name).write_text(lines)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "rows.jsonl").write_text(lines)  # one file naming no split: train, nothing to say
    with caplog.at_level("WARNING", logger="tasks.data_files"):
        assert len(SplitTable(str(tmp_path / "data"), schema=GSM8K_SCHEMA).rows("train")) == 2 * len(GSM)
        assert len(SplitTable(str(tmp_path / "one"), schema=GSM8K_SCHEMA).rows("train")) == len(GSM)
    warned = [r.getMessage() for r in caplog.records if r.name == "tasks.data_files"]
    assert len(warned) == 1 and "data: eval.jsonl names no split, so it is read as training data" in warned[0]


def test_a_blank_difficulty_is_no_rating(tmp_path):
    """The row check takes a whitespace difficulty as blank; the example then called float(" ") and raised,
    naming neither file nor row."""
    path = tmp_path / "dm.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _edit(DEEPMATH, 0, difficulty="  ")))
    examples = _deepmath(str(path)).examples("train")
    assert [e.difficulty for e in examples][:2] == [None, float(DEEPMATH[1]["difficulty"])]


def test_a_json_string_with_a_unicode_line_separator_stays_one_line(tmp_path):
    """``json.dumps(ensure_ascii=False)`` writes U+2028, U+2029 and U+0085 raw; ``splitlines`` cut the line there
    and refused valid JSONL ("Unterminated string")."""
    rows = [{"question": f"first{c}second", "answer": "#### 3"} for c in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows), encoding="utf-8")
    assert [row["question"] for row in read_rows(path)[0]] == [row["question"] for row in rows]


def test_a_missing_local_folder_is_refused_as_missing_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """``data/openthoughts`` before ``sgrpo.prepare_data`` ran looked like a hub id (owner/name): offline a
    ConnectionError from the hub, online retries on every process, and no word of the folder."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # a fresh checkout (no data/), then data/ without this set
        with pytest.raises(FileNotFoundError, match=r"path='data/gsm8k' does not exist \(looked from .*run "
                                                    r"python -m sgrpo.prepare_data"):
            GSM8K(path="data/gsm8k")
        (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "gsm").mkdir()
    for path in ("./gsm8k", "~/no-such-folder/gsm8k", "gsm/main"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            GSM8K(path=path)
    assert check_source("openai/gsm8k") == "hub"  # a hub id whose owner is no folder here
