"""Large sources stay memory-mapped: OpenThoughts (1.2M rows) and DeepMath are read lazily (``tasks.lazy_table``),
with the same checks, the same holdouts (the paper's, the hash, the random one) and the same rows as an eager read,
and a process that loads them holds positions, not rows."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sgrpo.lazy import Mapped, take
from tasks.data import SplitTable
from tasks.holdout import hash_holdout, paper_holdout, ranked_split
from tasks.lazy_table import LazySplitTable
from tasks.openthoughts import SCHEMA, OpenThoughts
from tests.preloaded import run

COLUMNS = ("conversations", "difficulty", "domain", "source")


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """``datasets``' Arrow copies go to the test's folder, not the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def write_openthoughts(folder, rows: int, files: int = 1, trace_chars: int = 200, seed: int = 0) -> int:
    """``rows`` rows in the OpenThoughts schema over ``files`` parquet files (prompts repeat: 1 in 3 rows shares its
    question with another); returns the bytes of the rows' text."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdefghij klmnop qrstu vwxyz ") for _ in range(1 << 16))
    folder.mkdir(parents=True, exist_ok=True)
    per, total = -(-rows // files), 0
    for k in range(files):
        batch = []
        for i in range(k * per, min(rows, (k + 1) * per)):
            start, question = rng.randrange(len(text) - trace_chars), i - 1 if i % 3 == 1 else i
            human, gpt = f"Question {question}: {text[question % 999:][:60]}", text[start:][:trace_chars]
            turns = [{"from": "human", "value": human}, {"from": "gpt", "value": f"<think>{gpt}</think> done"}]
            batch.append({"conversations": turns, "difficulty": i % 10, "domain": "math", "source": "synthetic"})
            total += len(human) + len(gpt) + 20
        name = f"train-{k:05d}-of-{files:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(batch), folder / name, row_group_size=1000)  # as the hub's files
    return total


def test_the_lazy_table_reads_split_folders_as_the_eager_table(tmp_path):
    """``train/`` and ``test/`` folders of parquet files: the lazy table takes the split from the folder, as the
    eager one does (both read every file as training data before)."""
    write_openthoughts(tmp_path / "ot" / "train", 30)
    write_openthoughts(tmp_path / "ot" / "test", 12, seed=1)
    for path in (tmp_path / "ot" / "test").glob("*.parquet"):
        path.rename(path.with_name("0000.parquet"))  # no split in the file's name
    lazy = LazySplitTable(str(tmp_path / "ot"), None, COLUMNS, SCHEMA, {"validation": 5}, 42)
    assert len(list(lazy.rows("test"))) == 12
    assert len(list(lazy.rows("train"))) + len(list(lazy.rows("validation"))) == 30


def test_a_lazy_folder_of_test_rows_only_reads_as_its_test_split(tmp_path):
    """The eager table reads a source of test rows only as it is; the lazy one refused it ("no train split")
    even with nothing to hold out; hidden files are no data for it either."""
    write_openthoughts(tmp_path / "ot", 12)
    for path in (tmp_path / "ot").glob("*.parquet"):
        path.rename(path.with_name("test-00000-of-00001.parquet"))
    (tmp_path / "ot" / ".cache").mkdir()
    (tmp_path / "ot" / ".cache" / "notes.jsonl").write_text("{}\n")  # not parquet, but hidden: still lazy
    lazy = LazySplitTable(str(tmp_path / "ot"), None, COLUMNS, SCHEMA, {"validation": 0}, 42)
    assert lazy.is_lazy() and lazy.splits() == ["test"] and len(list(lazy.rows("test"))) == 12
    with pytest.raises(ValueError, match="has no train split to hold validation out of"):
        LazySplitTable(str(tmp_path / "ot"), None, COLUMNS, SCHEMA, {"validation": 5}, 42).splits()


def test_shards_that_disagree_on_a_column_s_type_are_refused_naming_column_and_files(tmp_path):
    """``difficulty`` int64 in one shard and double in the other: datasets' concatenation failed naming no file."""
    from tasks.deepmath import DeepMath

    for k, difficulty in enumerate((lambda i: i, lambda i: i + 0.5)):
        rows = [{"question": f"q{k}-{i}", "final_answer": str(i), "difficulty": difficulty(i), "topic": "t"}
                for i in range(20)]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"train-0000{k}-of-00002.parquet")
    with pytest.raises(ValueError, match=r"path='.*': its files disagree on column 'difficulty''s type \(.*"
                                         r"train-00000-of-00002.parquet: Value\('int64'\); .*train-00001-of-00002"
                                         r".parquet: Value\('float64'\)\); write every file with one type"):
        DeepMath(path=str(tmp_path), validation_size=2).examples("train")


@pytest.mark.parametrize("holdout", ["paper", "hash"])
def test_the_lazy_table_holds_out_the_eager_table_s_rows(tmp_path, holdout):
    """Three files, repeated prompts: the same rows in the same order in every split, checked by the schema."""
    write_openthoughts(tmp_path / "ot", 3000, files=3)
    task = OpenThoughts(path=str(tmp_path / "ot"), holdout=holdout, validation_size=100)
    assert isinstance(task.examples("train"), Mapped) and isinstance(task._table, LazySplitTable)
    eager = SplitTable(str(tmp_path / "ot"), None, COLUMNS, SCHEMA, {"validation": 100, "test": 0}, 42,
                       group=task._table.group, carve=task._table.carve)  # fmt: skip
    for split in ("train", "validation"):
        assert list(task._table.rows(split)) == eager.rows(split)
    assert len(task.examples("validation")) > 100  # 100 prompts, some with two rows
    assert task.examples("train")[5] == task.examples("train")[5] and task.examples("train")[-1].answer
    assert pickle.loads(pickle.dumps(task.examples("train")))[7] == task.examples("train")[7]  # the async producer


def test_ranked_split_selects_what_the_row_holdouts_select():
    """``ranked_split`` over digests equals ``paper_holdout`` and ``hash_holdout`` over rows (repeats, 3 splits)."""
    import numpy as np

    from tasks.holdout import HashRanking, PaperCarver

    rng = random.Random(3)
    rows = [f"prompt {rng.randrange(400)}" for _ in range(1500)]
    carver = PaperCarver(lambda row: row)
    got = ranked_split(np.array([carver.digest(r, 7) for r in rows], dtype="S32"),
                       lambda n: carver.counts(n, {"validation": 25}))  # fmt: skip
    want = paper_holdout(rows, lambda row: row, 25, 7)
    assert {k: [rows[i] for i in v] for k, v in got.items()} == want
    sizes = {"validation": 30, "test": 0.05}
    hashing = HashRanking(lambda row: row)
    got = ranked_split(np.array([hashing.digest(r, 7) for r in rows], dtype="S32"), lambda n: hashing.counts(n, sizes))
    assert {k: [rows[i] for i in v] for k, v in got.items()} == hash_holdout(rows, lambda row: row, sizes, 7)


def test_the_random_holdout_and_a_limit_stay_lazy_and_equal(tmp_path):
    """DeepMath's random holdout on a lazy table: the eager table's rows; a limit and a filter copy positions."""
    from tasks.deepmath import DeepMath

    rows = [{"question": f"q{i}", "final_answer": str(i), "difficulty": 5.0, "topic": "t"} for i in range(500)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dm.parquet")
    task = DeepMath(path=str(tmp_path / "dm.parquet"), validation_size=0.1, seed=3, max_train_examples=100)
    eager = SplitTable(str(tmp_path / "dm.parquet"), sizes={"validation": 0.1, "test": 0}, seed=3)
    assert [e.answer for e in task.examples("validation")] == [r["final_answer"] for r in eager.rows("validation")]
    train = task.examples("train")
    assert isinstance(train, Mapped) and len(train) == 100
    assert [e.answer for e in train] == [r["final_answer"] for r in eager.rows("train")[:100]]
    assert isinstance(take(train, [3, 1]), Mapped) and [e.answer for e in take(train, [3, 1])] == [
        train[3].answer, train[1].answer]  # fmt: skip


def test_a_bad_row_of_a_lazy_file_names_the_file_and_the_row(tmp_path):
    write_openthoughts(tmp_path / "ot", 40, files=2)
    bad = [{"conversations": [{"from": "human", "value": "q"}], "difficulty": 1, "domain": "d", "source": "s"}]
    pq.write_table(pa.Table.from_pylist(bad * 3), tmp_path / "ot" / "train-00009-of-00009.parquet")
    where = r"train-00009-of-00009.parquet, row 1, column 'conversations': holds no 'gpt'"
    with pytest.raises(ValueError, match=where):
        OpenThoughts(path=str(tmp_path / "ot"), holdout="paper", validation_size=5).examples("train")


def test_an_empty_or_other_schema_parquet_file_is_refused_naming_it(tmp_path):
    """A file without rows failed in datasets (DatasetGenerationError: a traceback past the preflight), a file with
    none of the schema's columns with "Instruction 'train' corresponds to no data!": each named neither file nor
    column. Now as the eager table says them."""
    pq.write_table(pa.table({c: pa.array([], pa.string()) for c in COLUMNS}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty.parquet holds no rows; give a file with data"):
        OpenThoughts(path=str(tmp_path / "empty.parquet")).examples("train")
    chat = [{"messages": [{"role": "user", "content": "hi"}]}] * 5
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    where = r"chat.parquet, row 1, column 'conversations': missing; the source has columns \['messages'\]"
    with pytest.raises(ValueError, match=where):
        OpenThoughts(path=str(tmp_path / "chat.parquet")).examples("train")


RSS_SCRIPT = """
import gc, json, sys
from pathlib import Path
import datasets
datasets.config.HF_DATASETS_CACHE = Path(sys.argv[2])
from transformers import AutoTokenizer
from sgrpo.lazy import take
from sgrpo.rollout.prompt_limits import within_limit
from tasks.openthoughts import OpenThoughts
from tasks.arrow_rows import release_memory
from tasks.data import SplitTable
tokenizer = AutoTokenizer.from_pretrained("sgrpo/assets/quickstart_model")

def anon():  # in use: freed blocks handed back first (pyarrow's pool and glibc keep them)
    gc.collect()
    release_memory()
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("RssAnon:"))) * 1024

def load(task):  # the policy's data path: the split's examples, each row read, the prompt filter on a share
    examples = task.examples("train")
    assert sum(len(example.answer) for example in examples) > 0
    kept, _ = within_limit(take(examples, range(0, len(examples), 50)), tokenizer, 4096, "train")
    return examples, kept

load(OpenThoughts(path=sys.argv[3], holdout="paper", validation_size=5))  # warm: first-call allocations
before = anon()
held = load(OpenThoughts(path=sys.argv[1], holdout="paper", validation_size=500))
lazy = anon() - before
kind = type(held[0]).__name__
del held
before = anon()
rows = SplitTable(sys.argv[1], columns=["conversations"]).rows("train")  # every row in memory, as before
eager = anon() - before
print(json.dumps({"lazy": lazy, "eager": eager, "kind": kind}))
"""


@pytest.mark.slow
def test_loading_openthoughts_holds_positions_not_rows(tmp_path):
    """RssAnon (a process's own memory in use; memory-mapped pages are the page cache's, shared by the processes) when
    the task loads 6,000 rows (48 MB of text) and every row is read: a process that finds the machine's Arrow copy
    grows by under a tenth of the rows' bytes (1.7 MB measured), the first one, which converts the parquet files, by
    less than the rows (31 MB measured, the conversion's native buffers); an eager read of the same rows
    grows by more than 0.8 of their bytes. The old code held every row, so both failed."""
    size = write_openthoughts(tmp_path / "ot", 6_000, files=2, trace_chars=8000)
    write_openthoughts(tmp_path / "warm", 200)
    grew = []
    for _ in ("the first process, which converts", "a process that finds the copy"):  # forks (tests/preloaded.py)
        out = run([sys.executable, "-c", textwrap.dedent(RSS_SCRIPT), str(tmp_path / "ot"), str(tmp_path / "c"),
                   str(tmp_path / "warm")], cwd=Path.cwd(), env=dict(os.environ), timeout=240)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        grew.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"rows {size / 1e6:.0f} MB; RssAnon growth, MB: " + ", ".join(
        f"lazy {g['lazy'] / 1e6:.1f} (eager {g['eager'] / 1e6:.1f})" for g in grew))  # fmt: skip
    assert all(g["eager"] > 0.8 * size and g["kind"] == "Mapped" for g in grew)  # the measurement sees rows held
    assert grew[0]["lazy"] < size and grew[1]["lazy"] < size / 10


def test_the_training_stream_and_the_prompt_filter_read_lazy_examples_as_lists(tmp_path):
    """``StepBatches`` and ``within_limit`` (the policy's data path) give the same prompts from the lazy sequence as
    from its list; the filter's result stays lazy."""
    from transformers import AutoTokenizer

    from sgrpo.rollout.engine import render_prompt
    from sgrpo.rollout.prompt_limits import within_limit
    from sgrpo.run.data import EpochStepBatches, StepBatches

    write_openthoughts(tmp_path / "ot", 600, files=2)
    lazy = OpenThoughts(path=str(tmp_path / "ot"), holdout="paper", validation_size=20).examples("train")
    eager = list(lazy)
    for kind in (StepBatches, EpochStepBatches):
        streams = [kind(examples, 64, 5, 0, rank=1, world_size=2) for examples in (lazy, eager)]
        assert [streams[0].batch(s) for s in (0, 3, 9)] == [streams[1].batch(s) for s in (0, 3, 9)]
    tokenizer = AutoTokenizer.from_pretrained("sgrpo/assets/quickstart_model")
    texts = [render_prompt(tokenizer, ex.prompt) for ex in eager]
    limit = min(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])  # the shortest only
    (kept, dropped), (kept_list, dropped_list) = (within_limit(x, tokenizer, limit, "train") for x in (lazy, eager))
    assert isinstance(kept, Mapped) and list(kept) == kept_list and dropped == dropped_list and 0 < dropped < len(eager)


def test_a_lazy_source_s_dropped_rows_are_one_warning_with_the_total(tmp_path, monkeypatch, caplog):
    """A hub scan checks 512 rows at a time and warned once per batch with that batch's count: thousands of lines
    on OpenThoughts, and no total."""
    import datasets

    import tasks.arrow_rows as arrow_rows
    from tasks.deepmath import SCHEMAS
    from tests.test_tasks_data import DEEPMATH

    monkeypatch.setattr(arrow_rows, "BATCH", 2)  # 5 rows: 3 batches, a bad row in the first and the last
    rows = [dict(r) for r in DEEPMATH[:5]]
    rows[1]["final_answer"] = rows[4]["final_answer"] = ""
    write_openthoughts(tmp_path / "ot", 4)
    table = LazySplitTable(str(tmp_path / "ot"), None, COLUMNS, SCHEMA, {}, 42)
    table.schemas = SCHEMAS
    locate = lambda i: f"split 'train' row {i + 1}"  # noqa: E731
    with caplog.at_level("WARNING", logger="tasks.data"):
        kept, _ = table._scan([(datasets.Dataset.from_list(rows), list(rows[0]), "owner/name", locate, True)], None)
    assert len(kept) == 3
    warned = [r.getMessage() for r in caplog.records if r.name == "tasks.data"]
    assert len(warned) == 1 and warned[0].startswith("dropped 2 of 5 rows that fail the checks; the first: "
                                                     "owner/name, split 'train' row 2, column 'final_answer'")
