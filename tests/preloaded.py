"""Fresh processes without a fresh import: the tests' subprocess fits forked from one interpreter per pytest
worker that has imported torch, Lightning, transformers and sgrpo once.

A test that kills a fit, signals it, measures its memory or starts one process of a multi-process run needs a
process of its own, but a new interpreter spends 5-8 s of CPU importing before ``sgrpo.fit`` parses its first
argument (most of a 2-core machine's ``make test`` went there). ``popen(command, ...)`` takes the command a test
would give ``subprocess.Popen`` (``[sys.executable, "-m", MODULE | SCRIPT | "-c", CODE, ARGS...]``) and returns a
process with Popen's ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode``; ``run`` is
``subprocess.run(..., capture_output=True, text=True)``. The process is a fork of the worker's *preloader* (started
on first use, ``python tests/preloaded.py``, single-threaded when it forks: no thread pool has run there), which
then does what the interpreter would: its own session if asked, stdin from /dev/null, stdout and stderr to the
given files, the directory, the environment (``$TMPDIR`` read again), ``sys.argv`` and ``sys.path[0]``, Ctrl-C
raising ``KeyboardInterrupt``, and runs the module, script or code as ``__main__``; an exception or exit ends it as
it would end the interpreter. The preloader reaps it and reports its exit status (Popen's convention: ``-N`` for
signal N).

What differs from a new interpreter: the modules are imported already (as the fit would import them; what the
imports made is frozen out of the garbage collector's passes, ``gc.freeze``), under the session's environment (what
a module reads at import; the tests' processes differ from it in variables read at run time: ranks, ports,
``$TMPDIR``), and every process forked from one preloader has its hash seed (``PYTHONHASHSEED``): so a multi-process
test forks its process 0 only and starts the others fresh (Lightning's launcher starts its own), and the processes
keep different seeds. A test whose subject is a new interpreter (what it imports, a script run as a user runs it)
keeps ``subprocess``. ``SGRPO_TEST_FRESH=1`` starts every process fresh (``subprocess.Popen``), to check a test that
way (the converted tests pass either way; forked, a start costs ~6 s less CPU, and a short fit half its own).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FRESH = "SGRPO_TEST_FRESH"
#: the environment the preloader imports under: the session's, as the worker found it (a test's monkeypatched
#: variables are not), with one thread (every test's fit runs with OMP_NUM_THREADS=1)
SESSION_ENV = os.environ | {"OMP_NUM_THREADS": "1"}
#: what every forked process would import first (torch, Lightning, transformers and sgrpo.fit: ~6 s of CPU)
PRELOAD = ("torch", "lightning.pytorch", "transformers", "sgrpo.fit")  # not datasets: its import starts a thread


class Preloaded:
    """A process forked from the preloader (``subprocess.Popen``'s interface for what the tests use)."""

    def __init__(self, preloader: _Preloader, pid: int, args: list[str]) -> None:
        self.preloader, self.pid, self.args, self.returncode = preloader, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.preloader.pump(0.0)
            self.returncode = self.preloader.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.preloader.pump(0.5 if left is None else min(0.5, left))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Preloader:
    """The test's side of ``python tests/preloaded.py``: requests on its stdin, pids and exit statuses back."""

    def __init__(self) -> None:
        fd, log_path = tempfile.mkstemp(prefix="sgrpo-preloader-", suffix=".log")
        os.close(fd)
        self.log = Path(log_path)
        with open(self.log, "w") as log:  # its own output (the processes it forks write theirs to their files)
            self.process = subprocess.Popen([sys.executable, __file__], cwd=REPO, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, env=SESSION_ENV)  # fmt: skip
        self.exits: dict[int, int] = {}
        self.replies: list[dict] = []
        self.buffer = b""
        self.reply()  # ready

    def reply(self) -> dict:
        while not self.replies:
            assert self.process.poll() is None, f"the preloader ended: {self.log.read_text()[-3000:]}"
            self.pump(1.0)
        return self.replies.pop(0)

    def pump(self, timeout: float) -> None:
        """Read what the preloader has sent (waiting up to ``timeout`` s for the first bytes)."""
        out = self.process.stdout.fileno()
        while select.select([out], [], [], timeout)[0]:
            data = os.read(out, 65536)
            if not data:
                break
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            for reply in map(json.loads, lines):
                if "exit" in reply:
                    self.exits[reply["exit"]] = reply["code"]
                else:  # a new process: an exit read before it under its pid was an earlier one's (pids wrap)
                    self.exits.pop(reply.get("pid"), None)
                    self.replies.append(reply)
            timeout = 0.0

    def fork(self, request: dict) -> int | None:
        """The pid of the process forked for ``request``, or None where the preloader could not fork safely."""
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        return self.reply().get("pid")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.log.unlink(missing_ok=True)


_preloader: _Preloader | None = None


def shutdown() -> None:
    """End this worker's preloader, if it started one, and reap it (tests/conftest.py, at the session's end: its
    CPU then counts in the worker's, and an xdist worker may be ended before ``atexit`` runs)."""
    global _preloader
    if _preloader is not None:
        _preloader.close()
        _preloader = None


def popen(command: list[str], *, cwd: Path | str, env: dict[str, str], stdout: Path, stderr: Path | None = None,
          start_new_session: bool = False, fresh: bool = False) -> Preloaded | subprocess.Popen:  # fmt: skip
    """``command`` (``[sys.executable, ...]``) started as a fork of the preloader, its output to ``stdout`` (and
    ``stderr``, else the same file); a new interpreter (``subprocess.Popen``) if ``fresh`` or under
    ``SGRPO_TEST_FRESH=1``. Either way Ctrl-C raises ``KeyboardInterrupt`` in it (a background shell starts its jobs
    with Ctrl-C ignored, and the process would inherit that)."""
    global _preloader
    if not fresh and os.environ.get(FRESH) != "1" and command[0] == sys.executable and len(command) > 1:
        if _preloader is None:
            _preloader = _Preloader()
            atexit.register(shutdown)
        pid = _preloader.fork({"argv": command[1:], "cwd": str(cwd), "env": dict(env), "stdout": str(stdout),
                               "stderr": None if stderr is None else str(stderr), "session": start_new_session})
        if pid is not None:
            return Preloaded(_preloader, pid, command)
    out = open(stdout, "w")  # noqa: SIM115 (the child writes it)
    err = subprocess.STDOUT if stderr is None else open(stderr, "w")  # noqa: SIM115
    return subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            start_new_session=start_new_session, preexec_fn=_ctrl_c_raises)  # fmt: skip


def _ctrl_c_raises() -> None:  # as the preloader's processes: a background shell starts its jobs with Ctrl-C ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(command: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)`` through ``popen``, in a session
    of its own (a timeout kills the whole process group)."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())


# ------------------------------------------------------------------------------------------- the preloader
def _serve() -> None:
    """Import ``PRELOAD``, then fork a process per request line (JSON) on stdin, answering its pid, and report each
    one's exit status, until stdin closes."""
    import gc
    import importlib

    path = list(sys.path)
    for name in PRELOAD:
        importlib.import_module(name)
    sys.path[:] = path  # as a new interpreter's, whatever an import added
    # what the imports made stays out of the forks' collections (Python's advice for a fork server): else each
    # collection and the exit touched every object, copying its page (a 3-step fit 2.4 -> 1.2 s of CPU)
    gc.freeze()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what the forked processes start with
    _send({"ready": True})
    buffer = b""
    while True:
        if select.select([0], [], [], 0.02)[0]:
            data = os.read(0, 65536)
            if not data:
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                request = json.loads(line)
                threads = len(os.listdir("/proc/self/task"))  # a fork keeps one thread: forking with more is unsafe
                pid = os.fork() if threads == 1 else None
                if pid == 0:
                    _become(request)  # runs the command; never returns
                _send({"pid": pid})
        with contextlib.suppress(ChildProcessError):
            while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                _send({"exit": ended[0], "code": os.waitstatus_to_exitcode(ended[1])})


def _send(reply: dict) -> None:
    os.write(1, json.dumps(reply).encode() + b"\n")


def _become(request: dict) -> None:
    """In the forked process: what a new interpreter started with ``request`` would be, then its command."""
    import runpy
    import types

    if request["session"]:
        os.setsid()
    null, flags = os.open(os.devnull, os.O_RDONLY), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(request["stdout"], flags, 0o644)
    err = out if request["stderr"] is None else os.open(request["stderr"], flags, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):  # the preloader's pipes closed with them
        os.dup2(fd, target)
    for fd in {null, out, err}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # $TMPDIR as this process's environment has it
    flag, *rest = request["argv"]
    if flag == "-m":
        sys.argv, sys.path[0] = ["-m", *rest[1:]], os.getcwd()
        sys.modules.pop(rest[0], None)  # run as __main__ only, as ``python -m`` does (a preloaded sgrpo.fit)
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.argv, sys.path[0] = ["-c", *rest[1:]], ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(rest[0], "<string>", "exec"), main.__dict__)
    else:
        sys.argv, sys.path[0] = [flag, *rest], os.path.dirname(os.path.realpath(flag))
        runpy.run_path(flag, run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    _serve()
