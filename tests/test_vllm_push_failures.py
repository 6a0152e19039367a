"""VLLMServerRollout's failed pushes on CPU without vLLM, against stand-in servers that keep vLLM 0.32's update state
(``tests/fake_vllm_server.py``): a server that fails or hangs mid-push is named after the others finished and resumed,
an update left active (by a failed push, or an earlier run's) is completed by the next push, a failed transfer still
iterates every weight, a restarted server a transport cannot bring back raises. The real server:
``tests/test_vllm_server.py``."""

from __future__ import annotations

import time

import pytest
import torch

from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_http import ServerError, ServerPool, call
from sgrpo.rollout.vllm_push import CPUTransport, push
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.types import Example
from tests.fake_vllm_server import FakeServer
from tests.test_vllm_server_client import sent
from tests.test_vllm_server_client import servers as servers  # fixtures
from tests.test_vllm_server_client import tiny as tiny


def test_a_push_that_fails_midway_raises_and_the_next_rollout_pushes_again(servers, tiny):
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, sync_timeout=0.5)
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    bump_weights_version(model)
    server.delay = 2  # hangs in the push
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"{server.url}/.*no answer within 0.5 s"):
        engine.sync_weights(model)
    assert time.monotonic() - start < 3 and engine._pushed is None


def test_a_pause_that_waits_for_requests_in_flight_may_take_as_long_as_a_request(servers, tiny):
    """``/pause?mode=wait`` returns once the requests in flight finished (an async step's long generations): it gets
    ``request_timeout``, not ``sync_timeout`` (which used to drop a server that waited, still paused)."""
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, sync_timeout=0.5, request_timeout=5)
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    bump_weights_version(model)
    server.pause_delay = 1.5
    engine.sync_weights(model)
    assert engine._pushed == server.version and not server.paused


def rl_state(server: FakeServer) -> tuple[bool, bool]:
    return server.paused, server.active


def test_a_server_failing_mid_push_is_named_after_the_others_finished_and_resumed(servers, tiny):
    """Two servers, b fails its third chunk: a gets every chunk, the push's version and /resume (before, a was left
    paused in the update, and vLLM refuses the next /start_weight_update: the next push raised on the healthy one)."""
    model, tokenizer = tiny
    a, b = servers(), servers()
    engine = VLLMServerRollout(urls=[a.url, b.url], max_new_tokens=4, dtype="float32", weight_chunk_mib=0.01)
    bump_weights_version(model)
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    chunks = len(sent(a, "/update_weights"))
    assert chunks > 3
    bump_weights_version(model)
    b.fail_on, b.fail_after = {"/update_weights"}, 2
    with pytest.raises(ServerError, match=f"^{b.url}/update_weights: HTTP 500.*fake failure on /update_weights"):
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    assert engine._pushed is None
    assert len(sent(a, "/update_weights")) == 2 * chunks and len(sent(b, "/update_weights")) == chunks + 3
    assert a.version == f"sgrpo-{engine._tag}-2" and rl_state(a) == (False, False)  # finished, resumed
    assert rl_state(b) == (True, False)  # vLLM ended b's update when its chunk failed; b holds part of it, paused
    b.fail_on = set()
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)  # both take the next
    assert a.version == b.version == engine._pushed and rl_state(a) == rl_state(b) == (False, False)


def test_a_server_whose_answer_is_cut_short_is_named_after_the_others_finished_and_resumed(servers, tiny):
    """b's answer to ``/pause`` stops mid-body (it died answering): urllib raises ``http.client.IncompleteRead``, which
    used to leave the push from rank 0 before it read any weight (under FSDP2 the other processes then waited in the
    gathers until the process group's timeout) and a paused, never resumed. Now b is left out like any failed
    server: a gets every weight, the version and /resume, then b is named."""
    model, tokenizer = tiny
    a, b = servers(), servers()
    engine = VLLMServerRollout(urls=[a.url, b.url], max_new_tokens=4, dtype="float32", weight_chunk_mib=0.01)
    bump_weights_version(model)
    b.cut_on = {"/pause"}
    with pytest.raises(ServerError, match=f"^{b.url}/pause.*broken answer \\(IncompleteRead"):
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    assert len(sent(a, "/update_weights")) > 3 and not sent(b, "/update_weights")
    assert a.version == f"sgrpo-{engine._tag}-1" and rl_state(a) == (False, False) and not a.paused
    b.cut_on = set()
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    assert a.version == b.version == engine._pushed


def test_the_first_push_completes_an_update_an_earlier_run_left_active(servers, tiny, caplog):
    """A trainer that died mid-push left the server paused in an update; a new run's first push carries on in it
    (vLLM 0.32 has no abort, and refuses a second /start_weight_update), sends every weight and finishes it."""
    model, tokenizer = tiny
    server = servers()
    call(server.url + "/pause?mode=wait", {})
    call(server.url + "/start_weight_update", {})
    with pytest.raises(ServerError, match="weight update is already active"):  # the stand-in refuses as vLLM does
        call(server.url + "/start_weight_update", {})
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4)
    with caplog.at_level("WARNING", logger="sgrpo.rollout.vllm_push"):
        batch = engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    assert batch.input_ids.shape[0] == 1 and f"{server.url} was still in a weight update" in caplog.text
    assert server.version == engine._pushed and rl_state(server) == (False, False)


def test_a_transfer_that_fails_iterates_every_weight_and_the_next_push_completes_the_update(servers, tmp_path):
    """The chunk folder cannot be written: the sender still iterates the weights to their end (the other processes'
    gathers are collectives), the servers stay paused in the update, and the next push finishes it."""
    a, b = servers(), servers()
    pool = ServerPool([a.url, b.url], timeout=5)
    taken = []

    def weights():
        for i in range(6):
            taken.append(i)
            yield f"w{i}", torch.full((64,), float(i))

    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        push(pool, CPUTransport(folder=str(tmp_path / "file" / "chunks")), weights(), "v1", 256, sender=True)
    assert taken == list(range(6)) and rl_state(a) == rl_state(b) == (True, True)
    taken.clear()
    push(pool, CPUTransport(folder=str(tmp_path / "chunks")), weights(), "v2", 256, sender=True)
    assert taken == list(range(6)) and a.version == b.version == "v2"
    assert rl_state(a) == rl_state(b) == (False, False) and len(sent(a, "/update_weights")) == 6  # one a tensor


def test_a_restarted_server_of_a_transport_that_cannot_rejoin_raises_instead_of_pushing(servers, tiny):
    """NCCL's group spans every server: a push to a restarted one alone would wait for it in NCCL forever."""
    model, tokenizer = tiny

    class GroupTransport(CPUTransport):
        rejoins = False

    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, transport=GroupTransport())
    bump_weights_version(model)  # a known version (else every rollout pushes to all): alone, this test did not raise
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    server.version = "default"  # restarted
    with pytest.raises(ServerError, match=f"{server.url}: restarted; GroupTransport cannot bring a server back"):
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    # the same after an optimiser step (new weights: a push to every server, which used to skip the check), and
    # through the asynchronous producer's push (sync_weights itself)
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, transport=GroupTransport())
    engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    bump_weights_version(model)
    server.version = "default"
    with pytest.raises(ServerError, match=f"{server.url}: restarted; GroupTransport cannot bring a server back"):
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
    server.version = engine._pushed
    bump_weights_version(model)
    engine.sync_weights(model)  # every server holds the last push: no refusal
    server.version = "default"
    with pytest.raises(ServerError, match=f"{server.url}: restarted; GroupTransport cannot bring a server back"):
        engine.sync_weights(model, pause="keep")


def test_chunk_files_a_killed_trainer_left_are_deleted_at_the_first_push(tmp_path, monkeypatch):
    """A trainer killed mid-push (``kill -9``, ``hard_exit``'s ``os._exit``) runs no ``finally``: its chunk stayed in
    ``/dev/shm`` until a reboot (found by a review). The first push into the default folder deletes the files of
    processes that no longer run, and only those."""
    import os
    import subprocess
    import sys

    from sgrpo.rollout import vllm_push

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = tmp_path / f"sgrpo-weights-{ended.pid}-0123abcd-0.safetensors"
    kept = [tmp_path / f"sgrpo-weights-{os.getpid()}-0123abcd-0.safetensors", tmp_path / "sgrpo-weights-notes.txt",
            tmp_path / f"sgrpo-weights-{ended.pid}-4567abcd-0.safetensors"]  # the last one written just now: its PID
    # may be another PID namespace's (a container sharing /dev/shm), so it is left until it is STALE_AFTER_S old
    for path in (stale, *kept):
        path.write_bytes(b"x")
    old = time.time() - vllm_push.STALE_AFTER_S - 60
    os.utime(stale, (old, old))
    monkeypatch.setattr(vllm_push, "default_chunk_folder", lambda: str(tmp_path))
    transport = CPUTransport(folder=str(tmp_path))  # a folder given (maybe shared between machines): not swept
    transport.send(None, iter([]), 256, sender=True)
    assert stale.exists()
    transport = CPUTransport()
    transport.send(None, iter([]), 256, sender=True)
    assert not stale.exists() and all(path.exists() for path in kept)
    stale.write_bytes(b"x")
    os.utime(stale, (old, old))
    transport.send(None, iter([]), 256, sender=True)  # once per transport: a push is not slowed by a listing
    assert stale.exists()
