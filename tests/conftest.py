"""Test ordering for `make test`'s pytest-xdist workers."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``slow`` (2-process runs, subprocess fits: 10-40 s each) run first, in collection order, so
    that the fast tests fill the other worker while they run instead of one worker ending the suite alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: False (slow) sorts first
