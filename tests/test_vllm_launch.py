"""The vLLM servers sgrpo launches (``sgrpo.rollout.vllm_launch.VLLMServers``) on CPU without vLLM, with stand-in
server processes: the documented command, stop by PID (the whole process group, once its port is free), a port
another process serves refused, servers that end with the process that launched them, the multi-node host check.
The HTTP side: ``tests/test_vllm_server_client.py``; the real server: ``tests/test_vllm_server.py``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sgrpo.checks import ConfigError
from sgrpo.processes import group_running
from sgrpo.rollout import vllm_launch
from sgrpo.rollout.vllm_http import ServerError, call
from sgrpo.rollout.vllm_launch import VLLMServers, server_command
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.run import faults
from tests.test_vllm_server_client import closed_port_url
from tests.test_vllm_server_client import servers as servers  # fixture


def test_servers_started_on_the_first_node_at_a_loopback_host_are_refused_on_several_nodes():
    from sgrpo.run.launch_checks import check_launch_nodes

    policy = SimpleNamespace(rollout=VLLMServerRollout(launch=VLLMServers(ports=[8000], model="M")), val_rollout=None)
    check_launch_nodes(SimpleNamespace(num_nodes=1), policy)
    with pytest.raises(ConfigError, match="model.rollout.launch: the servers start on the first node at 127.0.0.1"):
        check_launch_nodes(SimpleNamespace(num_nodes=2), policy)
    for host in ("0.0.0.0", "::", "[::1]", "localhost", "127.0.1.1"):  # every interface: callers reach themselves
        policy.rollout.launch.host = host
        with pytest.raises(ConfigError, match=f"start on the first node at {re.escape(host)}, which the other 1 node"):
            check_launch_nodes(SimpleNamespace(num_nodes=2), policy)
    for host in ("10.0.0.5", "node-001"):  # an address, or a name, the other nodes reach
        policy.rollout.launch.host = host
        check_launch_nodes(SimpleNamespace(num_nodes=2), policy)


def test_servers_it_starts_run_the_documented_command_and_stop_by_pid(tmp_path):
    command = server_command("python", "MODEL", 8011, "127.0.0.1", "bfloat16", 2048, ["--enforce-eager"])
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--max-model-len"} <= set(command)
    port = int(closed_port_url().rsplit(":", 1)[1])
    exits = VLLMServers(ports=[port], python=sys.executable, startup_timeout=20, log_dir=str(tmp_path))
    with pytest.raises(ServerError, match=f"stopped while starting: the server on port {port} exited with code") as err:
        exits.start("MODEL", "float32", None, [])  # no vLLM in this venv: the server exits at once
    assert f"(log: {tmp_path / f'vllm-server-{port}.log'})" in str(err.value)  # its full path, not the name alone
    hangs = tmp_path / "hangs"  # a "python" that never answers /health
    hangs.write_text("#!/bin/sh\nexec sleep 600\n")
    hangs.chmod(0o755)
    launch = VLLMServers(ports=[port], python=str(hangs), startup_timeout=1, log_dir=str(tmp_path))
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"127.0.0.1:{port}: not healthy within 1 s"):
        launch.start("MODEL", "float32", None, [])
    assert time.monotonic() - start < 15 and launch.processes == []  # stopped, by its PID


#: a stand-in server process (``python -c HEALTH PORT``): every GET answered 200, as vLLM's /health
HEALTH = """import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_process_that_ends_at_once_stops_the_servers_it_launched(tmp_path, monkeypatch):
    """A failing process of a multi-process job ends by ``hard_exit`` (``os._exit``, no atexit hook): the servers it
    launched, in sessions of their own, kept their GPUs and answered the next run's ``/health``."""
    port = int(closed_port_url().rsplit(":", 1)[1])
    monkeypatch.setattr(vllm_launch, "server_command", lambda py, model, port, *_: [py, "-c", HEALTH, str(port)])
    launch = VLLMServers(ports=[port], python=sys.executable, startup_timeout=20, log_dir=str(tmp_path))
    launch.start("MODEL", "float32", None, [])
    server, exits = launch.processes[0], []
    monkeypatch.setattr(os, "_exit", exits.append)
    try:
        start = time.monotonic()
        faults.hard_exit([], 1)
        assert exits == [1] and time.monotonic() - start < 5
        assert server.poll() is not None, "hard_exit left the server it launched running"
        with pytest.raises(ServerError, match="unreachable"):
            call(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        launch.stop()


#: a stand-in server (``python -c LINGERS PORT READY``) whose forked child, as vLLM's engine process, holds the
#: listening port 2 s after a SIGTERM; the child writes its PID to the file READY once it handles the signal
LINGERS = """import http.server, os, signal, sys, time
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.BaseHTTPRequestHandler)
if os.fork() == 0:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), os._exit(0)))
    open(sys.argv[2], "w").write(str(os.getpid()))  # its handler is set
    while True:
        time.sleep(1)
server.serve_forever()
"""


def test_stop_returns_once_the_servers_child_processes_have_released_the_port(tmp_path, monkeypatch):
    """CI (stop 54): a server killed and started again on its port was refused as "another process already serves":
    ``stop`` returned once the guard was reaped, while the server's engine process still held the port."""
    port = int(closed_port_url().rsplit(":", 1)[1])
    ready = tmp_path / "ready"
    monkeypatch.setattr(vllm_launch, "server_command", lambda py, model, port, *_: [py, "-c", LINGERS, str(port),
                                                                                     str(ready)])  # fmt: skip
    monkeypatch.setattr(vllm_launch, "wait_until_healthy", lambda *_, **__: None)
    launch = VLLMServers(ports=[port], python=sys.executable, startup_timeout=20, log_dir=str(tmp_path))
    launch.start("MODEL", "float32", None, [])
    group = launch.processes[0].pid
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists() and vllm_launch._serving("127.0.0.1", port)
        launch.stop()
        child = Path(f"/proc/{ready.read_text()}/stat")  # gone, or a zombie (exited, awaiting its parent's wait)
        assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z", "stop() returned early"
        assert not vllm_launch._serving("127.0.0.1", port), "stop() returned while the port was still held"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def test_stop_ends_engine_processes_at_once_when_their_guard_has_exited(tmp_path):
    """A group whose leader (the guard) exited but whose engine process still runs got no SIGTERM: ``stop`` waited
    its whole grace before the SIGKILL (found by a review). Now the group is signalled as one that runs."""
    pid_file = tmp_path / "child"
    leader = subprocess.Popen([sys.executable, "-c", f"""import os, sys, time
if os.fork() == 0:
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    time.sleep(600)
"""], start_new_session=True)  # fmt: skip
    os.waitid(os.P_PID, leader.pid, os.WEXITED | os.WNOWAIT)  # it exited; not reaped, as stop() finds a dead guard
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    launch = VLLMServers(ports=[8000], log_dir=str(tmp_path))
    launch.processes = [leader]
    try:
        assert group_running(leader.pid)
        start = time.monotonic()
        launch.stop(grace=10)
        assert time.monotonic() - start < 5 and not group_running(leader.pid)
        # a guard reaped before stop(): its PID, the group's id, may be another process's by now: left alone
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        reaped = SimpleNamespace(pid=other.pid, returncode=0, poll=lambda: 0, wait=lambda timeout=None: 0)
        launch.processes = [reaped]
        launch.stop(grace=1)
        assert other.poll() is None, "stop() signalled a group that may not be its server's"
        other.kill()
        other.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)


def test_a_port_another_process_serves_is_refused_not_taken_for_the_started_server(servers, tmp_path, monkeypatch):
    """A server an earlier run left on the port answered ``/health`` for the one started there (which could not bind
    and exited): the run trained against the earlier run's server."""
    orphan = servers()
    port = int(orphan.url.rsplit(":", 1)[1])
    launch = VLLMServers(ports=[port], python=sys.executable, startup_timeout=20, log_dir=str(tmp_path))
    served = f"launch.ports: another process already serves 127.0.0.1:{port} .*: stop it .* or choose other ports"
    with pytest.raises(ServerError, match=served):
        launch.start("MODEL", "float32", None, [])
    assert launch.processes == [] and orphan.calls == []  # refused before starting anything
    # one that took the port after that check: the server started there exits while it answers /health
    monkeypatch.setattr(vllm_launch, "_serving", lambda host, port: False)
    monkeypatch.setattr(vllm_launch, "wait_until_healthy", lambda urls, timeout, alive: launch.processes[0].wait(20))
    with pytest.raises(ServerError, match=f"already serves .*, and the server on port {port} exited with code 1"):
        launch.start("MODEL", "float32", None, [])  # no vLLM in this venv: the server exits at once
    assert launch.processes == []


#: a trainer that launches one stand-in server, names its process group, and waits to be killed
LAUNCHER = """import sys, time
sys.path.insert(0, {repo!r})
from sgrpo.rollout import vllm_launch
vllm_launch.server_command = lambda py, model, port, *_: [py, "-c", {health!r}, str(port)]
launch = vllm_launch.VLLMServers(ports=[{port}], python=sys.executable, startup_timeout=20, log_dir={log!r})
launch.start("MODEL", "float32", None, [])
print(launch.processes[0].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a fresh interpreter, killed: 9-18 s
def test_servers_launched_by_a_process_killed_outright_stop_with_it(tmp_path):
    """``kill -9`` (or the OOM killer) runs no exit hook: the servers rank 0 launched, in sessions of their own, kept
    their GPUs and ports after it. Each now runs under ``vllm_guard.py``, which ends it when the killed process's end
    of its pipe closes."""
    port = int(closed_port_url().rsplit(":", 1)[1])
    script = tmp_path / "launcher.py"
    repo = str(Path(__file__).resolve().parents[1])
    script.write_text(LAUNCHER.format(repo=repo, port=port, log=str(tmp_path), health=HEALTH))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    group = None
    try:
        group = int(trainer.stdout.readline())  # the server's session (its parent's, or the server's own before)
        assert vllm_launch._serving("127.0.0.1", port)
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 15
        while vllm_launch._serving("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not vllm_launch._serving("127.0.0.1", port), "the server outlived the process that launched it"
    finally:
        trainer.kill()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)  # what a failure here left running
