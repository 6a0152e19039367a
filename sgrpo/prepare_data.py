"""``python -m sgrpo.prepare_data``: the paper's data sets downloaded once, at a pinned revision, into local folders.

Each data set's files (parquet / jsonl, its hub config's folder only) come from the hub at one commit into
``<root>/<name>/``, a folder that ``tasks.data.SplitTable`` reads as split files (``path: data/<name>``), so
every process of a run reads local files, never the hub. ``<root>/manifest.json`` records each data set's
repository, the commit its files came from and the files; a later run downloads the commit recorded there
(the pin) unless ``--revision NAME=COMMIT`` gives another, and the first run pins the commit that ``main``
resolved to. A data set already complete at its commit is not downloaded again.

    python -m sgrpo.prepare_data                         # all of them, into data/
    python -m sgrpo.prepare_data --only deepmath gsm8k   # some
    python -m sgrpo.prepare_data --revision deepmath=COMMIT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sgrpo.checks import ConfigError, exit_with_error

#: name -> (hub data set, the files of the config the paper uses)
SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gsm8k": ("openai/gsm8k", ("main/*.parquet",)),
    "countdown": ("Jiayi-Pan/Countdown-Tasks-3to4", ("*.parquet", "*.jsonl")),
    "countdown_gold": ("HuggingFaceTB/Countdown-Task-GOLD", ("verified_Qwen2.5-7B-Instruct/*.parquet",)),
    "deepmath": ("zwhe99/DeepMath-103K", ("*.parquet", "*.jsonl")),
    "openthoughts": ("open-thoughts/OpenThoughts3-1.2M", ("*.parquet",)),
    "polaris": ("POLARIS-Project/Polaris-Dataset-53K", ("*.parquet", "*.jsonl")),
    "aime25": ("math-ai/aime25", ("*.parquet", "*.jsonl")),
    "math500": ("HuggingFaceH4/MATH-500", ("*.parquet", "*.jsonl")),
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


def prepare(names: list[str], root: Path, revisions: dict[str, str], hub=None) -> dict[str, dict]:
    """Download ``names`` into ``root/<name>/`` at their pinned commits; returns (and writes) the manifest.

    ``hub`` supplies ``resolve(repo, revision) -> commit`` and ``download(repo, commit, patterns, folder) -> files``
    (default: huggingface_hub's; the tests give a fake).
    """
    hub = hub or HubClient()
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name in names:
        repo, patterns = SOURCES[name]
        pinned = manifest.get(name, {})
        commit = hub.resolve(repo, revisions.get(name) or pinned.get("commit") or "main")
        folder = root / name
        if pinned.get("commit") == commit and all((folder / f).exists() for f in pinned.get("files", [None])):
            print(f"{name}: {repo} at {commit} already in {folder}")
            continue
        files = sorted(hub.download(repo, commit, patterns, folder))
        if not files:
            raise ConfigError(f"{name}: {repo} at {commit} has no file matching {', '.join(patterns)}")
        manifest[name] = {"repo": repo, "commit": commit, "patterns": list(patterns), "files": files}
        root.mkdir(parents=True, exist_ok=True)
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {repo} at {commit} -> {folder} ({len(files)} files)")
    return manifest


class HubClient:
    """The hub through huggingface_hub: a revision resolved to its commit, files downloaded at a commit."""

    def resolve(self, repo: str, revision: str) -> str:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(repo, revision=revision).sha

    def download(self, repo: str, commit: str, patterns: tuple[str, ...], folder: Path) -> list[str]:
        from huggingface_hub import snapshot_download

        snapshot_download(repo, repo_type="dataset", revision=commit, allow_patterns=list(patterns), local_dir=folder)
        return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts]


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(prog="python -m sgrpo.prepare_data", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SOURCES), help="these data sets (default: all)")
    parser.add_argument("--root", type=Path, default=Path("data"), help="the folder of the data sets (data/)")
    parser.add_argument("--revision", nargs="+", default=[], metavar="NAME=COMMIT", help="download this commit")
    args = parser.parse_args(argv)
    try:
        return prepare(args.only or list(SOURCES), args.root, parse_revisions(args.revision))
    except ConfigError as err:
        exit_with_error(str(err), 2)


if __name__ == "__main__":
    main()
