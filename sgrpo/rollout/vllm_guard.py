"""The parent of a vLLM server that sgrpo launches (``sgrpo.rollout.vllm_launch``), run by path with the standard
library alone: ``python vllm_guard.py COMMAND...``.

It leads the session the server runs in, starts the server, and ends the session's processes (SIGTERM, SIGKILL after
``GRACE`` s) when its standard input closes: the trainer that launched it holds the pipe's other end, so the server
goes when the trainer goes, however it ends (``kill -9`` and the OOM killer too, which run no exit hook). A SIGTERM
(``VLLMServers.stop``) ends it the same way. It exits with the server's code (128 + N for a signal N).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

#: seconds the server gets between SIGTERM and SIGKILL
GRACE = 10.0


def main(command: list[str]) -> int:
    done, stopped = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: (stopped.set(), done.set()))  # the group's: the server has it too
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    threading.Thread(target=_wait_for_eof, args=(done,), daemon=True).start()
    while server.poll() is None and not done.wait(0.2):
        pass
    if server.poll() is None:  # the trainer is gone, or stops it: the whole session, the engine's processes too
        if not stopped.is_set():
            _signal_session(signal.SIGTERM)
        try:
            server.wait(GRACE)
        except subprocess.TimeoutExpired:
            _signal_session(signal.SIGKILL)  # this process too: the last thing it does
    code = server.wait()
    return 128 - code if code < 0 else code


def _wait_for_eof(done: threading.Event) -> None:
    try:
        while os.read(0, 4096):  # the raw descriptor: a daemon thread inside sys.stdin's buffer aborts the exit
            pass
    except OSError:
        pass
    done.set()


def _signal_session(sig: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process as well
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(0), sig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
