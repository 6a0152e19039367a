"""VLLMServerRollout's HTTP side on CPU without vLLM: routing, timeouts, error messages, the push's call sequence,
against stand-in servers (``tests/fake_vllm_server.py``). The real server: ``tests/test_vllm_server.py``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgrpo.checks import ConfigError
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import vllm_launch
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_http import ServerError, ServerPool, call
from sgrpo.rollout.vllm_launch import VLLMServers, server_command
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.run import faults
from sgrpo.run.preflight import check_rollout_servers
from sgrpo.types import Example
from tests.fake_vllm_server import FakeServer


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(**kwargs) -> FakeServer:
        made.append(FakeServer(**kwargs))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------------------- routing
def test_least_outstanding_routing_balances_and_avoids_the_busy_server(servers):
    a, b = servers(), servers()
    pool = ServerPool([a.url, b.url])
    first, second, third = pool.acquire(), pool.acquire(), pool.acquire()
    assert {first, second} == {a.url, b.url} and third == first  # alternate while equally busy
    pool.release(first)
    pool.release(third)  # `second` still has one in flight: the next goes to the other
    assert pool.acquire() == first and pool.outstanding() == {first: 1, second: 1}


def test_a_slow_server_gets_fewer_requests_and_answers_keep_request_order(servers):
    slow, fast = servers(delay=0.3), servers()
    pool = ServerPool([slow.url, fast.url], request_timeout=5)
    payloads = [{"token_ids": [i], "sampling_params": {"max_tokens": 2}} for i in range(12)]
    answers = pool.map("/inference/v1/generate", payloads, workers=4)
    assert len(answers) == 12 and all(a.body["choices"] for a in answers)
    served_slow = sum(path == "/inference/v1/generate" for path, _ in slow.calls)
    assert served_slow < 6 and served_slow + len(fast.calls) == 12  # the fast one took more than half
    assert [a.url for a in answers].count(slow.url) == served_slow


# ---------------------------------------------------------------------------------------------- failures
def test_a_dead_server_raises_at_once_naming_its_url():
    url = closed_port_url()
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"{url}/health: unreachable .*is the vLLM server running"):
        ServerPool([url]).check_health(timeout=5)
    assert time.monotonic() - start < 2


def test_a_hung_server_raises_within_the_timeout_naming_its_url(servers):
    hung = servers(delay=5)
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"{hung.url}/health: no answer within 0.3 s"):
        call(hung.url + "/health", timeout=0.3)
    assert time.monotonic() - start < 2


def test_a_connection_reset_while_the_request_is_sent_is_a_lost_connection(monkeypatch):
    """A server that dies while a request is sent resets the connection inside ``urlopen``: that was reported as
    "unreachable ... is the vLLM server running there?" (a refused connection's words), and the message depended on
    when the reset came (a CI run's flaky test); now it is a lost connection, as a reset while the answer is read."""
    import urllib.error
    import urllib.request

    for reset in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe")):
        monkeypatch.setattr(urllib.request, "urlopen", lambda *a, _e=reset, **k: (_ for _ in ()).throw(
            urllib.error.URLError(_e)))  # fmt: skip
        with pytest.raises(ServerError, match=r"http://h:1/x: connection lost \(.*\); did the vLLM server stop\?"):
            call("http://h:1/x", {"a": 1})
    refused = urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: (_ for _ in ()).throw(refused))
    with pytest.raises(ServerError, match=r"http://h:1/x: unreachable \(.*refused\); is the vLLM server running"):
        call("http://h:1/x")


def test_an_error_status_raises_with_the_server_s_message(servers):
    bad = servers(status=500)
    with pytest.raises(ServerError, match=f"{bad.url}/start_weight_update: HTTP 500 .*fake failure"):
        ServerPool([bad.url]).post(bad.url, "/start_weight_update")


def test_one_failing_request_fails_the_batch_naming_the_server(servers):
    good, bad = servers(), servers(status=500)
    pool = ServerPool([good.url, bad.url], request_timeout=5)
    with pytest.raises(ServerError, match=bad.url):
        pool.map("/inference/v1/generate", [{"token_ids": [1], "sampling_params": {"max_tokens": 2}}] * 4)


def test_pool_and_engine_refuse_bad_configs_naming_the_field():
    with pytest.raises(ValueError, match="urls: give at least one"):
        ServerPool([])
    with pytest.raises(ValueError, match="urls: a server is listed twice"):
        ServerPool(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="exactly one of urls"):
        VLLMServerRollout()
    with pytest.raises(ValueError, match="urls: 'localhost:8000' is not a server base URL"):
        VLLMServerRollout(urls=["localhost:8000"])
    with pytest.raises(ValueError, match="urls: .* is not a server base URL"):
        VLLMServerRollout(urls=["http://host:8000/v1"])
    with pytest.raises(ValueError, match="launch.ports: give distinct ports"):
        VLLMServers(ports=[8000, 8000])
    with pytest.raises(ValueError, match="launch.devices: one entry per port"):
        VLLMServers(ports=[8000, 8001], devices=["6"])


def test_preflight_names_the_key_of_a_server_that_is_not_up(servers, tmp_path):
    url = closed_port_url()
    down = VLLMServerRollout(urls=[servers().url, url])
    policy = SimpleNamespace(rollout=down, val_rollout=VLLMServerRollout(urls=[servers().url]))
    with pytest.raises(ConfigError, match=f"^model.rollout: urls: {url}/health: unreachable"):
        check_rollout_servers(policy)
    policy.rollout = policy.val_rollout
    check_rollout_servers(policy)  # both up
    missing = VLLMServerRollout(launch=VLLMServers(ports=[8000], python=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="model.val_rollout: launch.python: .*nope is not an executable"):
        check_rollout_servers(SimpleNamespace(rollout=policy.rollout, val_rollout=missing))


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_llama(tokenizer), tokenizer


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


def test_generate_builds_a_batch_and_pushes_only_changed_weights(servers, tiny):
    model, tokenizer = tiny
    a, b = servers(completion=[5, 6, 2]), servers(completion=[5, 6, 2])
    engine = VLLMServerRollout(urls=[a.url, b.url], max_new_tokens=4, dtype="float32")
    examples = [Example(prompt="s:31=", answer="13"), Example(prompt="s:4=", answer="4")]
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, examples, group_size=2)
    assert batch.input_ids.shape[0] == 4 and batch.completion_mask.sum().item() == 12
    assert torch.allclose(batch.logprobs[batch.completion_mask], torch.tensor(-0.5))
    pushed = engine._pushed
    assert engine.syncs == 1 and engine.last_weight_versions == [pushed] * 4
    for server in (a, b):  # the RL API's order, on every server
        rl = [p.split("?")[0] for p, _ in server.calls if p.split("?")[0] not in ("/health", "/inference/v1/generate")]
        assert rl[0] == "/init_weight_transfer_engine" and rl[1:3] == ["/pause", "/start_weight_update"]
        assert set(rl[3:-2]) == {"/update_weights"} and rl[-2:] == ["/finish_weight_update", "/resume"]
    requests = [body for p, body in a.calls + b.calls if p == "/inference/v1/generate"]
    assert sorted(r["token_ids"] for r in requests) == [[16, 15, 6, 4, 14], [16, 15, 7, 14]]  # ids, not text
    assert all(r["sampling_params"]["n"] == 2 and r["sampling_params"]["seed"] is not None for r in requests)
    bump_weights_version(model)  # arbitrary version: unknown models always push
    engine.generate(model, tokenizer, examples, group_size=2)
    assert engine.syncs == 2
    engine.generate(model, tokenizer, examples, group_size=2)  # unchanged weights: no push
    assert engine.syncs == 2
    a.version = "default"  # a restarted server: a full push to it alone, then it serves
    calls_b = len(b.calls)
    engine.generate(model, tokenizer, examples, group_size=2)
    assert engine.syncs == 3 and a.version == engine._pushed
    assert not any(p.startswith("/update_weights") for p, _ in b.calls[calls_b:])


def test_seeds_come_from_torch_s_rng_and_greedy_asks_for_one_completion(servers, tiny):
    model, tokenizer = tiny
    engine = VLLMServerRollout(urls=[servers().url], max_new_tokens=4)
    eos = [2]
    torch.manual_seed(7)
    seeds = torch.randint(2**31 - 1, (2,)).tolist()
    payloads = engine.request_payloads([[1, 2], [3]], seeds, 4, eos, greedy=False)
    assert [p["sampling_params"]["seed"] for p in payloads] == seeds
    greedy = engine.request_payloads([[1, 2]], [None], 4, eos, greedy=True)[0]["sampling_params"]
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and "seed" not in greedy


def test_a_server_that_dies_between_rollouts_raises_at_the_health_check(servers, tiny):
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, health_timeout=1)
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    server.stop()
    with pytest.raises(ServerError, match=f"{server.url}/health"):
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)


def test_answers_from_other_weights_raise(servers, tiny):
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4)
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    engine._pushed = "sgrpo-other-9"  # as if the server had been given other weights since
    engine._synced = None
    with pytest.raises(ServerError, match="sampled with weight versions"):
        answers = engine.pool.map("/inference/v1/generate", engine.request_payloads([[1]], [1], 1, [2], False))
        engine.batch_from_answers(answers, [[1]], 1, 0, tokenizer, torch.device("cpu"))


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
        assert vllm_launch._group_running(leader.pid)
        start = time.monotonic()
        launch.stop(grace=10)
        assert time.monotonic() - start < 5 and not vllm_launch._group_running(leader.pid)
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


def sent(server: FakeServer, path: str = "/inference/v1/generate") -> list:
    return [body for p, body in server.calls if p.split("?")[0] == path]


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
