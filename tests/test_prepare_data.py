"""``python -m sgrpo.prepare_data``: each data set downloaded once at a pinned commit, into local split files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgrpo.prepare_data import SOURCES, main, prepare
from tasks.data import SplitTable


class FakeHub:
    """The hub: ``main`` resolves to the newest commit; a download writes one parquet file per call."""

    def __init__(self) -> None:
        self.downloads: list[tuple[str, str]] = []

    def resolve(self, repo: str, revision: str) -> str:
        return "c2" if revision == "main" else revision

    def download(self, repo: str, commit: str, patterns, folder: Path) -> list[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.downloads.append((repo, commit))
        (folder / "main").mkdir(parents=True, exist_ok=True)
        table = pa.table({"question": ["1+1?", "2+2?"], "answer": [f"#### 2 {commit}", "#### 4"]})
        pq.write_table(table, folder / "main" / "train-00000-of-00001.parquet")
        return ["main/train-00000-of-00001.parquet"]


def test_a_data_set_is_pinned_at_its_first_commit_and_downloaded_once(tmp_path):
    hub = FakeHub()
    manifest = prepare(["gsm8k"], tmp_path, {}, hub)
    assert manifest["gsm8k"]["commit"] == "c2" and manifest["gsm8k"]["repo"] == SOURCES["gsm8k"][0]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    prepare(["gsm8k"], tmp_path, {}, hub)  # complete at its pinned commit: nothing downloaded
    assert hub.downloads == [("openai/gsm8k", "c2")]
    hub.resolve = lambda repo, revision: {"main": "c3"}.get(revision, revision)  # the hub moved on
    assert prepare(["gsm8k"], tmp_path, {}, hub)["gsm8k"]["commit"] == "c2"  # the pin holds
    assert prepare(["gsm8k"], tmp_path, {"gsm8k": "c1"}, hub)["gsm8k"]["commit"] == "c1"  # --revision moves it
    assert hub.downloads[-1] == ("openai/gsm8k", "c1")
    # the folder reads as a local source of split files
    rows = SplitTable(str(tmp_path / "gsm8k"), columns=("question", "answer")).rows("train")
    assert [r["question"] for r in rows] == ["1+1?", "2+2?"]


def test_a_bad_revision_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--revision", "nosuch=abc"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --revision 'nosuch=abc': give NAME=COMMIT with NAME one of")
