"""``python -m sgrpo.prepare_data``: the paper's data sets downloaded once, at a pinned revision, into local folders.

Each data set's files (``SOURCES``: the files of the hub config the paper uses) come from the hub at one commit into
``<root>/<name>/``, a folder that ``tasks.data.SplitTable`` reads as split files (``path: data/<name>``), so
every process of a run reads local files, never the hub. ``<root>/manifest.json`` records each data set's
repository, the commit its files came from and the files; a later run downloads the commit recorded there
(the pin) unless ``--revision NAME=COMMIT`` gives another, and the first run pins the commit that ``main``
resolved to. A data set already complete at its commit is not downloaded again.

Every pattern of a data set must match at least one file of the repository at that commit (listed before anything
is downloaded), else the run stops in one line naming the data set, the pattern and the fix. The files arrive in a
hidden staging folder (``<root>/.<name>.partial``) that replaces ``<root>/<name>`` only once complete, and the
manifest is rewritten after that, before the old folder goes: a failed or interrupted download leaves the previous
folder and manifest as they were, and files of an earlier commit never stay beside a new commit's. A data set
whose repository or patterns changed in ``SOURCES`` since it was pinned is downloaded again; one pinned at a full
commit and complete needs no hub (offline, on a compute node). Runs on one root may overlap: each data set is
taken by one of them at a time.

    python -m sgrpo.prepare_data                         # all of them, into data/
    python -m sgrpo.prepare_data --only deepmath gsm8k   # some
    python -m sgrpo.prepare_data --revision deepmath=COMMIT
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path

from sgrpo.checks import ConfigError, exit_with_error

#: name -> (hub data set, the files of the config the paper uses: each pattern must match at least one file).
#: Patterns are huggingface_hub's ``allow_patterns`` (``fnmatch``, case-sensitive; ``*`` also matches ``/``),
#: written from each repository's file listing and dataset card (docs/paper.md, step 1, says where from).
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gsm8k": ("openai/gsm8k", ("main/train-*.parquet", "main/test-*.parquet")),
    "countdown": ("Jiayi-Pan/Countdown-Tasks-3to4", ("data/train-*.parquet",)),
    "countdown_gold": ("HuggingFaceTB/Countdown-Task-GOLD", ("verified_Qwen2.5-7B-Instruct/*.parquet",)),
    "deepmath": ("zwhe99/DeepMath-103K", ("data/train-*.parquet",)),
    "openthoughts": ("open-thoughts/OpenThoughts3-1.2M", ("data/*.parquet",)),
    "polaris": ("POLARIS-Project/Polaris-Dataset-53K", ("polaris-data-53K.jsonl",)),
    "aime25": ("math-ai/aime25", ("test.jsonl",)),
    "math500": ("HuggingFaceH4/MATH-500", ("test.jsonl",)),
}


def parse_revisions(pairs: list[str]) -> dict[str, str]:
    """``["deepmath=abc123"]`` -> ``{"deepmath": "abc123"}``, refusing a malformed pair or an unknown name."""
    out = {}
    for pair in pairs:
        name, _, commit = pair.partition("=")
        if not commit or name not in SOURCES:
            raise ConfigError(f"--revision {pair!r}: give NAME=COMMIT with NAME one of {', '.join(SOURCES)}")
        out[name] = commit
    return out


def select(name: str, listing: list[str], commit: str) -> list[str]:
    """The files of ``listing`` (a repository's paths at ``commit``) that ``SOURCES[name]``'s patterns match, sorted;
    ``ConfigError`` in one line at the first pattern that matches none (naming the data set, the pattern, the fix)."""
    repo, patterns = SOURCES[name]
    chosen: set[str] = set()
    for pattern in patterns:
        matched = {path for path in listing if fnmatchcase(path, pattern)}
        if not matched:
            shown = ", ".join(sorted(listing)[:6]) + (", ..." if len(listing) > 6 else "")
            raise ConfigError(
                f"{name}: no file of {repo} at {commit} matches {pattern!r} (its files: {shown or 'none'}); give "
                f"--revision {name}=COMMIT of a commit that has it, or fix SOURCES[{name!r}] in sgrpo/prepare_data.py"
            )
        chosen |= matched
    return sorted(chosen)


def prepare(names: list[str], root: Path, revisions: dict[str, str], hub=None) -> dict[str, dict]:
    """Download ``names`` into ``root/<name>/`` at their pinned commits; returns (and writes) the manifest.

    ``hub`` supplies ``resolve(repo, revision) -> commit`` (``LookupError`` for an unknown repository or revision,
    ``ConnectionError`` for a hub it cannot reach), ``files(repo, commit) -> paths`` and ``download(repo, commit,
    patterns, folder) -> paths under folder`` (default: huggingface_hub's; the tests give a fake). Runs on one
    ``root`` at once (two terminals, every node of a job) take each data set in turn (``root/.<name>.lock``) and
    each rewrites only its own data sets' entries of the manifest.
    """
    hub = hub or HubClient()
    with contextlib.suppress(OSError):  # a read-only root that holds the data sets still serves them
        root.mkdir(parents=True, exist_ok=True)
    for name in names:
        with _locked(root / f".{name}.lock", f"{name}: waiting for another prepare_data run on {root}"):
            _prepare_one(name, root, revisions.get(name), hub)
    return read_manifest(root)


def _prepare_one(name: str, root: Path, revision: str | None, hub) -> None:
    repo, patterns = SOURCES[name]
    pinned = read_manifest(root).get(name, {})
    same = pinned.get("repo") == repo  # a data set moved to another repository: its old pin means nothing there
    pin = pinned.get("commit") if same else None
    folder, files = root / name, pinned.get("files") or []
    on_disk = bool(files) and all((folder / f).is_file() for f in files)
    complete = same and pinned.get("patterns") == list(patterns) and on_disk
    asked = revision is None or (pin or "").startswith(revision.lower()) and len(revision) >= 7  # the pin, or short
    if complete and asked and _FULL_COMMIT.fullmatch(pin or ""):  # no hub call: works offline
        print(f"{name}: {repo} at {pin} already in {folder}")
        return
    wanted_revision = revision or pin or "main"
    commit = _resolve(hub, name, repo, wanted_revision)
    if complete and pin == commit:
        print(f"{name}: {repo} at {commit} already in {folder}")
        return
    wanted = select(name, hub.files(repo, commit), commit)
    old = _download_into(folder, partial(hub.download, repo, commit, patterns), wanted, name)
    _set_entry(root, name, {"repo": repo, "commit": commit, "patterns": list(patterns), "files": wanted})
    shutil.rmtree(old, ignore_errors=True)  # only now: the manifest names what the folder holds
    print(f"{name}: {repo} at {commit} -> {folder} ({len(wanted)} files)")


#: a commit id in full: a pin that needs no lookup
_FULL_COMMIT = re.compile(r"[0-9a-f]{40}")


def _resolve(hub, name: str, repo: str, revision: str) -> str:
    """``revision``'s commit, or ``ConfigError`` in one line saying what to do."""
    try:
        return hub.resolve(repo, revision)
    except ConnectionError as err:
        raise ConfigError(
            f"{name}: cannot reach the hub to resolve {repo} at {revision!r} ({err}); run where the hub is reachable "
            "(a data set already complete at a full commit needs no hub)"
        ) from None
    except LookupError as err:
        if "Repository" in str(err) or "Gated" in str(err):
            raise ConfigError(
                f"{name}: cannot access {repo} ({err}): log in (hf auth login) and accept its terms if it is gated, "
                f"or fix SOURCES[{name!r}] in sgrpo/prepare_data.py"
            ) from None
        raise ConfigError(
            f"{name}: {repo} has no revision {revision!r} ({err}); give --revision {name}=COMMIT with a commit "
            f"of {repo}"
        ) from None


def read_manifest(root: Path) -> dict[str, dict]:
    """``root/manifest.json`` (empty if none), or ``ConfigError`` naming it when it is not JSON."""
    path = root / "manifest.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError as err:
        raise ConfigError(
            f"{path} is not valid JSON ({err}): restore it, or delete it to pin every data set again at main"
        ) from None


def _set_entry(root: Path, name: str, entry: dict) -> None:
    """The manifest with ``name``'s entry set, read and written under ``root/.manifest.lock``: another run's
    entries, written since this one started, stay."""
    with _locked(root / ".manifest.lock", None):
        manifest = read_manifest(root) | {name: entry}
        _write_atomically(root / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")


@contextmanager
def _locked(path: Path, waiting: str | None):
    """An exclusive ``fcntl.flock`` on ``path`` while the block runs; ``waiting`` printed if another holds it. Where
    no lock can be taken (a read-only root, which no run can write either; a file system without locks, Lustre
    mounted ``noflock``) the block runs unlocked, as before locks."""
    with contextlib.ExitStack() as stack:
        try:
            handle = stack.enter_context(open(path, "a"))
        except OSError:  # EROFS, EACCES: nobody writes here
            handle = None
        if handle is not None and _lock(handle, waiting):
            stack.callback(fcntl.flock, handle, fcntl.LOCK_UN)
        yield


def _lock(handle, waiting: str | None) -> bool:
    """Take ``handle``'s exclusive lock, waiting (and saying ``waiting``) while another run holds it; False where the
    file system has no locks (ENOLCK, ENOSYS, EOPNOTSUPP)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if waiting:
            print(waiting, flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:
        return False
    return True


def _download_into(folder: Path, download, wanted: list[str], name: str) -> Path:
    """Run ``download(staging)`` into a hidden staging folder beside ``folder`` and, once it holds exactly ``wanted``,
    put it in ``folder``'s place; on any failure the staging folder is removed and ``folder`` is left as it was.
    Returns where the replaced folder waits (``.<name>.old``) until the manifest names the new one."""
    staging, old = folder.with_name(f".{name}.partial"), folder.with_name(f".{name}.old")
    for leftover in (staging, old):  # of a run killed before it could clean up
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        got = sorted(download(staging))
        if got != wanted:
            missing, extra = sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))
            raise ConfigError(
                f"{name}: the download holds other files than the repository's listing (missing {missing[:3]}, "
                f"extra {extra[:3]}); run again, or fix SOURCES[{name!r}] in sgrpo/prepare_data.py"
            )
        if folder.exists():
            folder.rename(old)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not folder.exists():
            old.rename(folder)
        raise
    return old


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds either its old text or ``text``, never a part of it (the new text on disk before the rename:
    a crash cannot leave an empty file)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


class HubClient:
    """The hub through huggingface_hub: a revision resolved to its commit, a commit's files listed and downloaded."""

    def resolve(self, repo: str, revision: str) -> str:
        import httpx
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

        try:
            return HfApi().dataset_info(repo, revision=revision).sha
        except (RepositoryNotFoundError, RevisionNotFoundError) as err:  # GatedRepoError is a RepositoryNotFoundError
            raise LookupError(type(err).__name__) from None
        except (OSError, HfHubHTTPError, httpx.HTTPError) as err:  # offline mode, no route, the hub's 5xx
            raise ConnectionError(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None

    def files(self, repo: str, commit: str) -> list[str]:
        from huggingface_hub import HfApi

        return HfApi().list_repo_files(repo, repo_type="dataset", revision=commit)

    def download(self, repo: str, commit: str, patterns: tuple[str, ...], folder: Path) -> list[str]:
        from huggingface_hub import snapshot_download

        snapshot_download(repo, repo_type="dataset", revision=commit, allow_patterns=list(patterns), local_dir=folder)
        shutil.rmtree(folder / ".cache", ignore_errors=True)  # huggingface_hub's download metadata, not data
        return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def main(argv: list[str] | None = None, hub=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(prog="python -m sgrpo.prepare_data", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SOURCES), help="these data sets (default: all)")
    parser.add_argument("--root", type=Path, default=Path("data"), help="the folder of the data sets (data/)")
    parser.add_argument("--revision", nargs="+", default=[], metavar="NAME=COMMIT", help="download this commit")
    args = parser.parse_args(argv)
    try:
        return prepare(args.only or list(SOURCES), args.root, parse_revisions(args.revision), hub)
    except ConfigError as err:
        exit_with_error(str(err), 2)


if __name__ == "__main__":
    main()
