"""A stop during a rollout over several processes (sgrpo.rollout_stop.RolloutStop), in one process: the signal
handler's request, the watch that posts it in the process group's store and reads another process's, the
decoder's checks and the lockstep all-reduce that carries it, SIGTERM ignored while a stop saves. The 2-process
jobs (a SIGTERM in the rollout, both processes exit 143, the resume equals the uninterrupted run) are
tests/test_faults_processes.py's, in `make test-bench`."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from sgrpo.rollout import decode as decoding
from sgrpo.rollout_stop import ROLLOUT_STOP, RolloutStop, RolloutStopped
from sgrpo.run.faults import STOP_KEY, AbortWatch
from sgrpo.run.signals import StopRequests


@pytest.fixture
def process_group():
    """A one-process gloo group on a TCPStore (as torchrun and srun give), destroyed afterwards."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()


@pytest.fixture
def window():
    """``ROLLOUT_STOP`` with its window open (a training rollout of several processes), closed afterwards."""
    ROLLOUT_STOP.signum, ROLLOUT_STOP.open, ROLLOUT_STOP.posted = 0, True, False
    yield ROLLOUT_STOP
    ROLLOUT_STOP.signum, ROLLOUT_STOP.open, ROLLOUT_STOP.posted = 0, False, False


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_request_is_taken_only_while_a_rollout_window_is_open():
    stop = RolloutStop()
    assert not stop.request(signal.SIGTERM) and not stop.requested  # no rollout: the step's end decides
    stop.open = True
    assert stop.request(signal.SIGTERM) and stop.requested and stop.signum == signal.SIGTERM
    with pytest.raises(RolloutStopped):
        stop.check()
    stop.open = False
    stop.check()  # closed: nothing to leave


def test_the_watch_posts_this_process_stop_and_reads_another_one(process_group, window):
    """The process that got the signal posts it (``STOP_KEY``); a process that got none reads it from the store
    within the watch's period, and its rollout leaves at the next check."""
    watch = AbortWatch(rank=0, period=0.05, on_abort=lambda: None)
    watch.start()
    try:
        window.request(signal.SIGTERM)
        assert wait_until(lambda: process_group.check([STOP_KEY])), "the stop was not posted"
        assert process_group.get(STOP_KEY) == str(int(signal.SIGTERM)).encode()
        window.signum, window.posted = 0, False  # another process, which got no signal of its own
        assert wait_until(lambda: window.requested), "the posted stop was not read"
        assert window.signum == signal.SIGTERM and window.posted  # read, not posted again
    finally:
        watch.stop()


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def test_the_decoder_leaves_at_its_next_check_once_a_stop_is_requested(window, monkeypatch):
    """A stop requested during the 4th decode step (a signal, or a notice read by the watch) ends the rollout at
    the next check (every token on the CPU): 5 forwards of 30, not 30."""
    model, steps = llama(), []
    call = decoding.DecodeSteps.__call__

    def counted(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 4:
            window.request(signal.SIGTERM)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(decoding.DecodeSteps, "__call__", counted)
    ids, mask = torch.randint(2, 40, (2, 4)), torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(RolloutStopped):
        decoding.decode(model, ids, mask, torch.arange(2), 30, [1], pad=0, min_new_tokens=30)
    assert len(steps) == 4


def test_under_lockstep_decoding_the_stop_rides_on_the_running_rows_all_reduce(process_group, window):
    """FSDP2's lockstep decode: every process learns of a stop in the all-reduce it runs at each check anyway."""
    assert decoding.running_anywhere(True, torch.device("cpu"))
    window.request(signal.SIGTERM)
    with pytest.raises(RolloutStopped):
        decoding.running_anywhere(True, torch.device("cpu"))


def test_sigterm_during_the_rollout_is_taken_and_ignored_while_the_stop_saves(window, capsys):
    """The handler hands a SIGTERM in a rollout of several processes to ``agree`` and returns (every process stops
    at its rollout's next check); once the stop saves (``uninstall(stopping=True)``), another SIGTERM (SLURM
    signals every task, at slightly different times) is noted and ignored: it used to end the process there."""
    previous = signal.getsignal(signal.SIGTERM)
    stops = StopRequests()
    stops.install(agree=window.request)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_until(lambda: window.requested)
        assert stops.signum == signal.SIGTERM and "every process stops at its rollout's next check" in (
            capsys.readouterr().err
        )
        stops.uninstall(stopping=True)
        os.kill(os.getpid(), signal.SIGTERM)  # would end this test process under the default handler
        time.sleep(0.05)  # the handler runs in the main thread, between two bytecodes
        assert "SIGTERM: already stopping" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rollout_that_fails(rank: int, asked: bool | None):
    """True: a stop asked for, then the servers' error; False: the error alone; None: a stop asked for, then an error
    that is not an outside engine's (the same error, not in ``gone``)."""
    from sgrpo.rollout.vllm_http import ServerError

    stop = RolloutStop()

    def rollout():
        if asked is not False:  # the SIGTERM every process of the job step got: recorded by the handler
            stop.request(signal.SIGTERM)
        raise ServerError("http://127.0.0.1:8000/inference/v1/generate: connection lost; did the vLLM server stop?")

    try:
        return stop.run(rollout, torch.device("cpu"), gone=(ServerError,) if asked is not None else ())
    except ServerError as err:
        return f"raised: {err}"


def test_a_rollout_that_fails_once_a_stop_was_asked_for_stops_every_process(tmp_path, capsys):
    """SLURM's SIGTERM reaches the vLLM servers sgrpo launched as well (a job step's every process): a multi-process
    rollout waiting on them failed with the servers' error, which ended the job as a failure with nothing saved
    (found by a review). A rollout that fails after its process was asked to stop now ends as the stop: every
    process gets the signal back and saves the last step's end. Without a stop asked for, the error stands."""
    from tests.gloo_pair import run_pair

    assert run_pair(_rollout_that_fails, [True, True], tmp_path / "asked") == {0: (None, 15), 1: (None, 15)}
    failed = run_pair(_rollout_that_fails, [False, False], tmp_path / "not")
    assert all(str(failed[r]).startswith("raised: http://127.0.0.1:8000") for r in (0, 1))
    # an error that is not an outside engine's (one in the rollout's own collectives) raises even while stopping
    failed = run_pair(_rollout_that_fails, [None, None], tmp_path / "own")
    assert all(str(failed[r]).startswith("raised: http://127.0.0.1:8000") for r in (0, 1))
