"""VLLMServerRollout's HTTP side on CPU without vLLM: routing, timeouts, error messages, the push's call sequence,
against stand-in servers (``tests/fake_vllm_server.py``). The servers sgrpo launches: ``tests/test_vllm_launch.py``;
the real server: ``tests/test_vllm_server.py``."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch

from sgrpo.checks import ConfigError
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_http import ServerError, ServerPool, call
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_server import VLLMServerRollout
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


def test_processes_that_tie_start_on_different_servers():
    """4 processes x 2 prompts a step on 4 servers, each process's pool at 0 in flight as a step starts: in list
    order every process sent both to the first two servers, then both to the last two (4, 4, 0, 0 each step; found
    by a review). Rotated by rank, every server gets 2 a step."""
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    pools = [ServerPool(urls, rank=rank) for rank in range(4)]
    for _ in range(3):  # steps
        load = dict.fromkeys(urls, 0)
        for pool in pools:
            taken = [pool.acquire(), pool.acquire()]
            for url in taken:
                load[url] += 1
                pool.release(url)
        assert list(load.values()) == [2, 2, 2, 2]


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


def test_a_404_on_an_endpoint_a_flag_turns_on_names_the_flag(servers):
    """A server started by hand without VLLM_SERVER_DEV_MODE=1 or --enable-scale-out answered the first push or
    rollout with a bare "HTTP 404 Not Found" (found by a review): the error now names what starts it with the
    endpoint; another 404 stays as it was."""
    missing = servers(status=404)
    pool = ServerPool([missing.url])
    with pytest.raises(ServerError, match="/init_weight_transfer_engine: HTTP 404 .*VLLM_SERVER_DEV_MODE=1"):
        pool.post(missing.url, "/init_weight_transfer_engine")
    with pytest.raises(ServerError, match="/inference/v1/generate: HTTP 404 .*--enable-scale-out"):
        pool.post(missing.url, "/inference/v1/generate", {"token_ids": [1]})
    with pytest.raises(ServerError, match=r"/v1/models: HTTP 404 [^;]*$"):
        pool.get(missing.url, "/v1/models")


def test_a_server_unreachable_through_a_proxy_names_the_proxy(monkeypatch):
    """A cluster shell's http_proxy without a no_proxy entry carried every call, 127.0.0.1's too, and its refusal
    read as if the server were down (found by a review)."""
    url = closed_port_url()
    monkeypatch.setenv("http_proxy", url)  # a proxy that refuses, as that one did
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(ServerError, match=f"through the proxy {url}: add 127.0.0.1 to no_proxy"):
        ServerPool([url]).check_health(timeout=5)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    with pytest.raises(ServerError, match=r"is the vLLM server running there\?$"):
        ServerPool([url]).check_health(timeout=5)


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


def test_preflight_refuses_a_server_whose_log_probs_are_not_the_sampler_s(servers):
    """A server started by hand without ``--logprobs-mode processed_logprobs`` answers vLLM's default, log-probs
    before temperature and top-p: every importance ratio was off at temperature != 1, and nothing said so (found by
    a review). The preflight reads each server's mode (``/server_info``) and refuses naming it and the flag."""
    good, raw = servers(), servers()
    raw.logprobs_mode = "raw_logprobs"
    policy = SimpleNamespace(rollout=VLLMServerRollout(urls=[good.url, raw.url]), val_rollout=None)
    with pytest.raises(ConfigError, match=f"model.rollout: urls: {raw.url} reports log-probs raw_logprobs.*"
                                          "--logprobs-mode processed_logprobs"):  # fmt: skip
        check_rollout_servers(policy, keys=("rollout",))
    raw.logprobs_mode = "processed_logprobs"
    check_rollout_servers(policy, keys=("rollout",))
    assert ("/server_info?config_format=json", None) in raw.calls


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_llama(tokenizer), tokenizer


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


def sent(server: FakeServer, path: str = "/inference/v1/generate") -> list:
    return [body for p, body in server.calls if p.split("?")[0] == path]


def test_a_second_server_engine_on_the_rollout_s_servers_is_refused_where_it_cannot_push():
    """``val_rollout`` a second VLLMServerRollout on the same servers (other sampling settings for validation): each
    engine takes the other's push for a restart, and NCCL cannot bring a restarted server back, so the first
    training rollout after a validation raised (found by a review). Refused before any model loads; a transport
    that rejoins only pushes once more, and servers of its own share nothing."""
    from estimators import GRPO
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout.vllm_push import NCCLTransport
    from tasks.synthetic import SyntheticTask

    task, url = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2), "http://10.0.0.1:8000"

    def policy(val_url: str, transport) -> GRPOPolicy:
        train = VLLMServerRollout(urls=[url], transport=transport())
        val = VLLMServerRollout(urls=[val_url], temperature=0.6, transport=transport())
        return GRPOPolicy("unused", task, GRPO(), rollout=train, val_rollout=val)

    with pytest.raises(ValueError, match=r"model.val_rollout: a second VLLMServerRollout on model.rollout's servers "
                                         r"\(http://10.0.0.1:8000\).*NCCLTransport.*val_rollout: null"):  # fmt: skip
        policy(url, NCCLTransport)
    policy("http://10.0.0.2:8000", NCCLTransport)
    policy(url, lambda: None)  # CPUTransport: rejoins
