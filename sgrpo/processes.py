"""This machine's processes by PID, read from ``/proc`` (a process that has exited and awaits its parent's ``wait``,
a zombie, holds no port, memory or GPU, so it counts as ended), with ``kill(pid, 0)`` where there is no ``/proc``."""

from __future__ import annotations

import os


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the process's name (state, parent, process group, ...), or None where
    the process is gone or there is no ``/proc``. The name, in parentheses, may itself hold ")"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int | None) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    if pid is None:
        return False
    fields = proc_stat(pid)
    if fields is not None:
        return fields[0] not in ("Z", "X")
    if os.path.isdir("/proc"):  # gone
        return False
    try:
        os.kill(pid, 0)  # no /proc (macOS): exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def group_running(group: int) -> bool:
    """Whether a process of process group ``group`` still runs (zombies aside); without ``/proc``, whether the group
    has any process."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for pid in pids:
        fields = proc_stat(pid)  # None: it ended meanwhile
        if fields is not None and len(fields) > 2 and int(fields[2]) == group and fields[0] not in ("Z", "X"):
            return True
    return False
