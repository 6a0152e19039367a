"""Test ordering for `make test`'s pytest-xdist workers, and benchmark artefacts kept out of the tree."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``slow`` (2-process runs, subprocess fits: 10-40 s each) run first, in collection order, so
    that the fast tests fill the other worker while they run instead of one worker ending the suite alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: False (slow) sorts first


@pytest.fixture(autouse=True)
def _benchmark_artefacts_to_tmp(tmp_path_factory, monkeypatch):
    """A test that runs a benchmark publishes into a temporary folder, never over the committed
    ``benchmarks/reports/`` (``benchmarks/artefact.py``)."""
    from benchmarks import artefact

    monkeypatch.setattr(artefact, "REPORTS", tmp_path_factory.mktemp("reports"))
