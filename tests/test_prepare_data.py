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
    """Every file under ``root`` (hidden ones too) and its bytes, but the runs' lock files (empty, they stay)."""
    files = (p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".lock")
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


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


def test_two_runs_on_one_root_keep_each_other_s_pins(tmp_path):
    """A run read the manifest once and wrote its own copy after each data set: one finishing during another's
    download lost its entry, and the next run downloaded that data set again at whatever main was then."""
    hub = FakeHub({"c2": GSM8K + ["test.jsonl"]})
    download = hub.download

    def slow_download(repo, commit, patterns, folder):  # another run prepares aime25 meanwhile
        if repo == SOURCES["gsm8k"][0]:
            prepare(["aime25"], tmp_path, {}, hub)
        return download(repo, commit, patterns, folder)

    hub.download = slow_download
    manifest = prepare(["gsm8k"], tmp_path, {}, hub)
    assert sorted(manifest) == ["aime25", "gsm8k"] and json.loads((tmp_path / "manifest.json").read_text()) == manifest


def test_a_complete_data_set_pinned_at_a_full_commit_needs_no_hub(tmp_path, capsys):
    """Offline (HF_HUB_OFFLINE, a compute node) a complete data set was looked up anyway and the run died in a
    traceback; now it is left as it is, and one that does need the hub stops in one line."""
    commit = "0123456789abcdef" * 2 + "01234567"
    hub = FakeHub({commit: GSM8K, "c2": GSM8K})
    prepare(["gsm8k"], tmp_path, {"gsm8k": commit}, hub)

    def unreachable(repo, revision):
        raise ConnectionError("OfflineModeIsEnabled: offline")

    hub.resolve = unreachable
    assert prepare(["gsm8k"], tmp_path, {}, hub)["gsm8k"]["commit"] == commit and len(hub.downloads) == 1
    with pytest.raises(SystemExit) as refused:
        main(["--only", "aime25", "--root", str(tmp_path)], hub)
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: aime25: cannot reach the hub to resolve math-ai/aime25 at 'main' (OfflineModeIsEnabled: offline); "
        "run where the hub is reachable (a data set already complete at a full commit needs no hub)"
    ]


def test_a_data_set_whose_patterns_changed_is_downloaded_again(tmp_path, monkeypatch):
    """The completeness check compared the commit and files only: a pattern fixed in SOURCES never took effect."""
    hub = FakeHub({"c2": GSM8K + ["main/validation-00000-of-00001.parquet"]})
    prepare(["gsm8k"], tmp_path, {}, hub)
    repo, patterns = SOURCES["gsm8k"]
    monkeypatch.setitem(SOURCES, "gsm8k", (repo, (*patterns, "main/validation-*.parquet")))
    manifest = prepare(["gsm8k"], tmp_path, {}, hub)
    assert len(hub.downloads) == 2 and "main/validation-00000-of-00001.parquet" in manifest["gsm8k"]["files"]
    assert (tmp_path / "gsm8k" / "main" / "validation-00000-of-00001.parquet").is_file()


def test_an_interrupt_while_the_old_folder_is_removed_leaves_the_manifest_naming_the_new_one(tmp_path, monkeypatch):
    """The old folder was deleted (seconds for a large data set) before the manifest was rewritten: Ctrl-C there
    left the new commit's files under the old pin, and the next run called them complete."""
    import sgrpo.prepare_data as module

    hub = FakeHub()
    prepare(["gsm8k"], tmp_path, {"gsm8k": "c1"}, hub)
    remove = module.shutil.rmtree

    def interrupted(path, *args, **kwargs):
        if Path(path).name == ".gsm8k.old" and Path(path).exists():  # not the leftover check at the start
            raise KeyboardInterrupt
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(module.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(["gsm8k"], tmp_path, {"gsm8k": "c2"}, hub)
    assert json.loads((tmp_path / "manifest.json").read_text())["gsm8k"]["commit"] == "c2"
    rows = SplitTable(str(tmp_path / "gsm8k"), columns=("question", "answer")).rows("train")
    assert [r["answer"] for r in rows] == ["#### 2 c2", "#### 4"]


@pytest.mark.parametrize("case", ["empty_manifest", "no_repository"])
def test_a_broken_manifest_or_an_inaccessible_repository_stops_in_one_line(case, tmp_path, capsys):
    hub = FakeHub()
    if case == "empty_manifest":  # a crash between write and rename (no fsync) left it empty
        (tmp_path / "manifest.json").write_text("")
    else:  # a gated, private or renamed repository: another commit cannot help
        hub.resolve = lambda repo, revision: (_ for _ in ()).throw(LookupError("GatedRepoError"))
    with pytest.raises(SystemExit) as refused:
        main(["--only", "gsm8k", "--root", str(tmp_path)], hub)
    assert refused.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1
    assert {"empty_manifest": "manifest.json is not valid JSON", "no_repository": "cannot access openai/gsm8k "
            "(GatedRepoError): log in (hf auth login)"}[case] in line[0]  # fmt: skip


def test_without_locks_or_write_access_a_complete_data_set_is_still_served(tmp_path, monkeypatch, capsys):
    """Every run took a lock file first: a read-only data root (EROFS) or a file system without flock (Lustre
    noflock: ENOSYS) ended in a traceback, even for a complete data set offline. Now they run unlocked; a short sha of
    the pin also needs no hub."""
    import builtins
    import errno

    import sgrpo.prepare_data as module

    commit = "0123456789abcdef" * 2 + "01234567"
    hub = FakeHub({commit: GSM8K})
    prepare(["gsm8k"], tmp_path, {"gsm8k": commit}, hub)
    hub.resolve = lambda repo, revision: (_ for _ in ()).throw(ConnectionError("offline"))

    def no_flock(handle, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(module.fcntl, "flock", no_flock)
    assert prepare(["gsm8k"], tmp_path, {}, hub)["gsm8k"]["commit"] == commit
    monkeypatch.undo()

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(module, "open", read_only, raising=False)
    monkeypatch.setattr(hub, "resolve", lambda repo, revision: (_ for _ in ()).throw(ConnectionError("offline")))
    assert prepare(["gsm8k"], tmp_path, {"gsm8k": commit[:7]}, hub)["gsm8k"]["commit"] == commit
    assert capsys.readouterr().out.count("already in") == 2 and len(hub.downloads) == 1
