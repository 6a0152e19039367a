"""``SOURCES`` against the hub's layouts as public listings and dataset cards show them (docs/paper.md, step 1,
says which and from when), and the folders ``prepare_data`` writes read by each paper config's task.

Each listing below is a repository's files as its "Files and versions" page or its card's ``configs:`` block showed
them; where a page did not show a folder's files, the names are marked as assumed. A pattern must pick exactly the
config's files (not the card, the images or other configs' folders) and they must fall into the splits the task
reads."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from sgrpo.prepare_data import SOURCES, select
from tasks.data_files import split_of

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

#: name -> (the repository's files, the files the paper's config uses, their splits)
LAYOUTS = {
    # card's configs block (commit 60b4b82): main: main/train-*, main/test-*; socratic: socratic/...
    "gsm8k": (
        [
            ".gitattributes",
            "README.md",
            "main/train-00000-of-00001.parquet",
            "main/test-00000-of-00001.parquet",
            "socratic/train-00000-of-00001.parquet",
            "socratic/test-00000-of-00001.parquet",
        ],
        ["main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet"],
        {"train", "test"},
    ),
    # tree/main/data (commit 408f70d): one file, 490,364 rows
    "countdown": (
        [".gitattributes", "data/train-00000-of-00001.parquet"],
        ["data/train-00000-of-00001.parquet"],
        {"train"},
    ),
    # tree/main: one folder per config; all/ and test/ hold <split>-00000-of-00001.parquet (seen), the
    # verified_* folders' file names are assumed to follow them
    "countdown_gold": (
        [
            ".gitattributes",
            "README.md",
            "all/train-00000-of-00001.parquet",
            "test/test-00000-of-00001.parquet",
            "verified_Qwen2.5-0.5B-Instruct/train-00000-of-00001.parquet",
            "verified_Qwen2.5-7B-Instruct/train-00000-of-00001.parquet",
            "verified_Qwen3-4B-Instruct-2507/train-00000-of-00001.parquet",
        ],
        ["verified_Qwen2.5-7B-Instruct/train-00000-of-00001.parquet"],
        {"train"},
    ),
    # tree/main/data (commit d5c865c) and the card's configs block: default: data/train-*
    "deepmath": (
        [".gitattributes", "README.md", "assets/github-DeepMath.png"]
        + [f"data/train-{i:05d}-of-00010.parquet" for i in range(10)],
        [f"data/train-{i:05d}-of-00010.parquet" for i in range(10)],
        {"train"},
    ),
    # tree/main (commit 61bcf9d): data/, README.md, ot3-datacuration-pipeline.png; data/'s file names assumed
    "openthoughts": (
        [".gitattributes", "README.md", "ot3-datacuration-pipeline.png"]
        + [f"data/train-{i:05d}-of-00120.parquet" for i in range(120)],
        [f"data/train-{i:05d}-of-00120.parquet" for i in range(120)],
        {"train"},
    ),
    # tree/main (commit 296f8e3): one jsonl file, no configs block (the hub reads it as train)
    "polaris": ([".gitattributes", "README.md", "polaris-data-53K.jsonl"], ["polaris-data-53K.jsonl"], {"train"}),
    # tree/main (commit 7510e41); pinned as 563bb84's test.jsonl by other projects
    "aime25": ([".gitattributes", "README.md", "test.jsonl"], ["test.jsonl"], {"test"}),
    # tree at 2343f79 (Upload test.jsonl), README added in ff5b202
    "math500": ([".gitattributes", "README.md", "test.jsonl"], ["test.jsonl"], {"test"}),
}


def test_every_data_set_has_a_recorded_layout():
    assert set(LAYOUTS) == set(SOURCES)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_patterns_pick_exactly_the_config_files_from_the_hub_layout(name):
    listing, expected, splits = LAYOUTS[name]
    chosen = select(name, listing, "abc")
    assert chosen == sorted(expected)
    assert {split_of(Path(path), Path()) for path in chosen} == splits  # the paths from the repository root


def build(spec):
    """An object from a config's ``{class_path, init_args}`` block (nested blocks built first)."""
    if isinstance(spec, dict) and "class_path" in spec:
        module, _, name = spec["class_path"].rpartition(".")
        return getattr(importlib.import_module(module), name)(**build(spec.get("init_args", {})))
    if isinstance(spec, dict):
        return {key: build(value) for key, value in spec.items()}
    return [build(value) for value in spec] if isinstance(spec, list) else spec


def write(folder: Path, files: list[str], fixture: str) -> None:
    """The fixture's rows at each of ``files`` under ``folder``, as parquet or jsonl as the file's name says."""
    path = FIXTURES / fixture
    rows = pq.read_table(path).to_pylist() if path.suffix == ".parquet" else [
        json.loads(line) for line in path.read_text().splitlines() if line.strip()]  # fmt: skip
    for file in files:
        target = folder / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), target)
        else:
            target.write_text("".join(json.dumps(row) + "\n" for row in rows))


#: name -> (the paper config whose task reads it, the fixture in its schema, what docs/paper.md step 2 overrides)
READERS = {
    "gsm8k": ("gsm8k.yaml", "gsm8k.jsonl", {}),
    "countdown": ("countdown.yaml", "countdown.jsonl", {}),
    "countdown_gold": ("countdown_sim.yaml", "countdown_gold.jsonl", {"config": None}),
    "deepmath": ("deepmath.yaml", "deepmath.parquet", {}),
    "openthoughts": ("openthoughts.yaml", "openthoughts.jsonl", {}),
    "polaris": ("qwen3_1.7b.yaml", "polaris.jsonl", {}),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_paper_task_reads_the_folder_prepare_data_writes(name, tmp_path):
    config, fixture, overrides = READERS[name]
    write(tmp_path / name, LAYOUTS[name][1], fixture)
    if name == "polaris":
        for evaluation in ("aime25", "math500"):
            write(tmp_path / evaluation, LAYOUTS[evaluation][1], f"{evaluation}.jsonl")
        overrides = {"evaluation_sets": {e: str(tmp_path / e) for e in ("aime25", "math500")}}
    spec = yaml.safe_load((REPO / "configs" / "paper" / config).read_text())["model"]["task"]
    spec["init_args"] |= {"path": str(tmp_path / name), **overrides}
    task = build(spec)
    assert len(task.examples("train")) > 0 and len(task.examples("validation")) > 0
    if name == "polaris":  # AIME 2025 and MATH-500 from their test.jsonl, 3 rows each
        assert {task.evaluation_set(e) for e in task.examples("validation")} == {"aime25", "math500"}


def test_a_folder_of_test_rows_reads_as_its_test_split_and_refuses_train_in_one_line(tmp_path):
    from tasks.data import SplitTable

    write(tmp_path / "aime25", ["test.jsonl"], "aime25.jsonl")
    table = SplitTable(str(tmp_path / "aime25"))
    assert table.splits() == ["test"] and len(table.rows("test")) == 3
    with pytest.raises(ValueError, match=r"aime25' has no train split \(found \['test'\]\); give a source with train"):
        table.rows("train")
