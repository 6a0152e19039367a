"""``python -m sgrpo.prepare_data``: each data set downloaded once at a pinned commit, into local split files; a
pattern that matches nothing, an unknown revision or a failed download stops in one line and leaves data/ as it was."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from sgrpo.prepare_data import SOURCES, main, prepare
from tasks.data import SplitTable

GSM8K = ["README.md", "main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"]


class FakeHub:
    """The hub: ``main`` resolves to the newest commit; ``layouts`` maps a commit to its files (each written as a
    two-row parquet file naming its commit); ``fail_after`` files into a download, it raises as a dropped link would."""

    def __init__(self, layouts: dict[str, list[str]] | None = None, fail_after: int | None = None) -> None:
        self.layouts = layouts or {"c1": GSM8K, "c2": GSM8K}
        self.fail_after = fail_after
        self.downloads: list[tuple[str, str]] = []

    def resolve(self, repo: str, revision: str) -> str:
        commit = "c2" if revision == "main" else revision
        if commit not in self.layouts:
            raise LookupError("RevisionNotFoundError")
        return commit

    def files(self, repo: str, commit: str) -> list[str]:
        return list(self.layouts[commit])

    def download(self, repo: str, commit: str, patterns, folder: Path) -> list[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.downloads.append((repo, commit))
        wanted = [f for f in self.layouts[commit] if any(fnmatchcase(f, p) for p in patterns)]
        for count, path in enumerate(wanted):
            if count == self.fail_after:
                raise ConnectionError("the link dropped")
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            table = pa.table({"question": ["1+1?", "2+2?"], "answer": [f"#### 2 {commit}", "#### 4"]})
            pq.write_table(table, folder / path)
        return wanted


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) and its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_data_set_is_pinned_at_its_first_commit_and_downloaded_once(tmp_path):
    hub = FakeHub()
    manifest = prepare(["gsm8k"], tmp_path, {}, hub)
    assert manifest["gsm8k"]["commit"] == "c2" and manifest["gsm8k"]["repo"] == SOURCES["gsm8k"][0]
    assert manifest["gsm8k"]["files"] == sorted(GSM8K[1:])  # the config's files, not the card
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    prepare(["gsm8k"], tmp_path, {}, hub)  # complete at its pinned commit: nothing downloaded
    assert hub.downloads == [("openai/gsm8k", "c2")]
    hub.layouts["c3"] = GSM8K  # the hub moved on
    hub.resolve = lambda repo, revision: {"main": "c3"}.get(revision, revision)
    assert prepare(["gsm8k"], tmp_path, {}, hub)["gsm8k"]["commit"] == "c2"  # the pin holds
    assert prepare(["gsm8k"], tmp_path, {"gsm8k": "c1"}, hub)["gsm8k"]["commit"] == "c1"  # --revision moves it
    assert hub.downloads[-1] == ("openai/gsm8k", "c1")
    # the folder reads as a local source of split files: the official train and test splits
    table = SplitTable(str(tmp_path / "gsm8k"), columns=("question", "answer"))
    assert table.splits() == ["test", "train"]
    assert [r["answer"] for r in table.rows("train")] == ["#### 2 c1", "#### 4"]


def test_moving_the_revision_replaces_the_folder_leaving_no_file_of_the_old_commit(tmp_path):
    sharded = ["main/train-00000-of-00002.parquet", "main/train-00001-of-00002.parquet", GSM8K[2]]
    hub = FakeHub({"c1": sharded, "c2": GSM8K})
    prepare(["gsm8k"], tmp_path, {"gsm8k": "c1"}, hub)
    manifest = prepare(["gsm8k"], tmp_path, {"gsm8k": "c2"}, hub)
    on_disk = sorted(p.relative_to(tmp_path / "gsm8k").as_posix() for p in (tmp_path / "gsm8k").rglob("*.parquet"))
    assert on_disk == manifest["gsm8k"]["files"] == sorted(GSM8K[1:])
    assert len(SplitTable(str(tmp_path / "gsm8k")).rows("train")) == 2  # not c1's two shards beside c2's file


def test_a_pattern_matching_no_file_fails_in_one_line_and_writes_nothing(tmp_path, capsys):
    hub = FakeHub({"c2": ["README.md", "main/train-00000-of-00001.parquet"]})  # no test split at this commit
    with pytest.raises(SystemExit) as refused:
        main(["--only", "gsm8k", "--root", str(tmp_path)], hub)
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: gsm8k: no file of openai/gsm8k at c2 matches 'main/test-*.parquet'")
    assert "--revision gsm8k=COMMIT" in err[0] and "SOURCES['gsm8k'] in sgrpo/prepare_data.py" in err[0]
    assert hub.downloads == [] and snapshot(tmp_path) == {}  # refused before any download: data/ untouched


def test_a_failed_download_leaves_the_previous_folder_and_manifest_as_they_were(tmp_path):
    hub = FakeHub()
    prepare(["gsm8k"], tmp_path, {"gsm8k": "c1"}, hub)
    before = snapshot(tmp_path)
    hub.fail_after = 1  # the second file of c2 never arrives
    with pytest.raises(ConnectionError):
        prepare(["gsm8k"], tmp_path, {"gsm8k": "c2"}, hub)
    assert snapshot(tmp_path) == before  # c1's files and manifest, no half of c2, no staging folder
    hub.fail_after = None
    assert prepare(["gsm8k"], tmp_path, {"gsm8k": "c2"}, hub)["gsm8k"]["commit"] == "c2"  # a rerun completes it


def test_a_first_download_that_fails_leaves_no_folder(tmp_path):
    with pytest.raises(ConnectionError):
        prepare(["gsm8k"], tmp_path, {}, FakeHub(fail_after=1))
    assert snapshot(tmp_path) == {}


def test_a_download_that_misses_a_listed_file_is_refused(tmp_path):
    hub = FakeHub()
    hub.download = lambda repo, commit, patterns, folder: []  # the hub listed files the download did not bring
    with pytest.raises(ValueError, match=r"gsm8k: the download holds other files than the repository's listing"):
        prepare(["gsm8k"], tmp_path, {}, hub)
    assert snapshot(tmp_path) == {}


def test_an_unknown_revision_fails_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--only", "gsm8k", "--root", str(tmp_path), "--revision", "gsm8k=nosuch"], FakeHub())
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: gsm8k: openai/gsm8k has no revision 'nosuch' (RevisionNotFoundError); give --revision "
        "gsm8k=COMMIT with a commit of openai/gsm8k"
    ]
    assert snapshot(tmp_path) == {}


def test_a_bad_revision_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--revision", "nosuch=abc"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --revision 'nosuch=abc': give NAME=COMMIT with NAME one of")
