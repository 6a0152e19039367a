"""docs/runs.md's "Metric keys" names every key the code logs: each literal ``train/...`` key in the library's
source, and the keys built from a list (the budget table's buckets, the episodes' quantities, the loss's statistics)."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

from estimators.budget import BUCKETS
from sgrpo.eval.metrics import EPISODE_METRICS
from sgrpo.train.loss import ClippedSurrogate

REPO = Path(__file__).resolve().parents[1]


def documented() -> list[str]:
    """The section's key patterns: ``{a,b}`` expanded, ``<name>`` and ``*`` as wildcards."""
    text = (REPO / "docs" / "runs.md").read_text()
    section = text.split("## Metric keys", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for span in re.findall(r"`((?:train|val|test)/[^`]+)`", section):
        span = re.sub(r"<[^>]+>", "*", span)
        parts = re.split(r"\{([^}]*)\}", span)  # literal, choices, literal, ...
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        patterns += ["".join(c) for c in itertools.product(*choices)]
    return patterns


def logged() -> set[str]:
    """Literal keys in the source, and the keys built from lists."""
    keys = set()
    for path in [*(REPO / "sgrpo").rglob("*.py"), *(REPO / "estimators").rglob("*.py")]:
        for key in re.findall(r'f?"((?:train|val|test)/[^"{]+)"', path.read_text()):
            keys.add(key)
    keys -= {"train/"}
    keys |= {f"train/budget/{norm}/{bucket}" for norm in ("l1", "l2") for bucket in BUCKETS}
    keys |= {f"{split}/episode/{name}" for split in ("train", "val") for name in EPISODE_METRICS}
    keys |= {f"train/{name}" for name in (*ClippedSurrogate.stats, "entropy")}
    return keys


def test_every_logged_key_is_in_the_metric_list():
    patterns = documented()
    missing = sorted(k for k in logged() if not any(fnmatch.fnmatchcase(k, p) for p in patterns))
    assert missing == [], f"docs/runs.md's Metric keys misses {missing}"
    assert not fnmatch.fnmatchcase("train/no_such_key", "train/reward")  # the matching is strict
