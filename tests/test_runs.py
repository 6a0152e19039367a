"""The run folder's lock: exclusive while held, naming its holder, and naming nobody once released."""

from __future__ import annotations

import os

import pytest

from sgrpo.runs import LOCK_FILE, RunRefused, lock_run, unlock_run


def test_a_held_lock_names_its_process_and_a_released_one_names_nobody(tmp_path):
    lock = lock_run(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(RunRefused, match=rf"in use by pid {os.getpid()} on "):
        lock_run(tmp_path)  # a second handle is a second lock holder: refused while the first holds it
    unlock_run(lock)
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean exit leaves no stale 'pid N' naming a dead process
    unlock_run(lock_run(tmp_path))  # and the folder can be claimed again
