"""An async run that stops (SIGTERM, Ctrl-C) while its vLLM servers are gone: the step's end is still saved."""

from __future__ import annotations

import pytest


def test_a_push_that_fails_while_the_run_stops_is_skipped_and_logged(caplog):
    """SLURM's SIGTERM reaches the vLLM servers sgrpo launched as well as the trainer (every process of the job step):
    the trainer finished its step, but the push after the update met the stopped servers and raised, so the step's
    end was never saved and the resume went back to the last periodic checkpoint (found by a review). With a stop
    recorded the failed push is skipped (the resumed run pushes first); without one it raises as before."""
    import logging
    from types import SimpleNamespace

    from sgrpo.rollout.vllm_http import ServerError
    from sgrpo.train.asynchronous import AsyncRollouts

    class Dead:
        def push(self, weights, version, attention=None):
            raise ServerError("http://127.0.0.1:8000/pause: connection lost; did the vLLM server stop?")

    class Policy(AsyncRollouts):
        def __init__(self, signum) -> None:
            self._producer, self.rollout_step, self.sync_every, self._async = Dead(), 4, 1, {"weight_sync_s": 9.0}
            self.model = None  # no attention implementation to carry
            self.trainer = SimpleNamespace(callbacks=[SimpleNamespace(), SimpleNamespace(stops=SimpleNamespace(
                signum=signum))])  # fmt: skip

        def _plain_weights(self):
            return iter([])

    with pytest.raises(ServerError, match="connection lost"):
        Policy(None).push_weights()
    stopping = Policy(15)
    with caplog.at_level(logging.WARNING, "sgrpo.train.asynchronous"):
        stopping.push_weights()
    assert stopping._async["weight_sync_s"] == 0.0
    assert "the weights of step 4 reached no vLLM server" in caplog.text and "while the run stops" in caplog.text
