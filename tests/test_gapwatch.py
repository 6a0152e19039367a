"""GapWatch: the warning of a sampler-trainer gap that jumps above its running level (no vLLM needed)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from sgrpo.train.gapwatch import GapWatch
from sgrpo.train.update import PolicyUpdate


def warned_steps(watch: GapWatch, gaps: list[float]) -> list[int]:
    return [step for step, gap in enumerate(gaps) if watch.observe(step, gap)]


def test_level_is_the_moving_average_of_unflagged_steps_by_hand():
    watch = GapWatch(factor=10.0, floor=1e-3, alpha=0.5, warmup=2, every=3)
    assert watch.observe(0, 0.004) is None and watch.level == 0.004  # L_1 = g_1
    assert watch.observe(1, 0.002) is None and watch.level == pytest.approx(0.003)  # 0.5 * 0.004 + 0.5 * 0.002
    # 10 x 0.003 = 0.03: 0.029 is not a jump, 0.031 is
    assert watch.observe(2, 0.029) is None and watch.level == pytest.approx(0.016)
    message = watch.observe(3, 0.5)
    assert message.startswith("step 3: the sampler-trainer log-prob gap (mean |d log p|) is 0.5, 31x")
    assert "stale weights" in message and watch.level == pytest.approx(0.016)  # a flagged step leaves the level


def test_warns_once_then_every_n_steps_while_the_jump_lasts_and_again_after_recovery():
    watch = GapWatch(factor=10.0, warmup=3, every=4)
    gaps = [0.003] * 5 + [0.6] * 10 + [0.003] * 3 + [0.8] * 2  # a failed sync at step 5, recovery at 15, again at 18
    assert warned_steps(watch, gaps) == [5, 9, 13, 18]
    assert watch.level == pytest.approx(0.003)  # the jumps never became the running level


def test_no_warning_during_warmup_below_the_floor_or_for_noise():
    # the first steps only set the level: a high start is not a jump
    assert warned_steps(GapWatch(warmup=3), [0.5, 0.4, 0.6, 0.5, 0.45]) == []
    # float32 rounding (1e-7) wobbling to 5e-4 stays under factor x floor = 1e-2
    assert warned_steps(GapWatch(), [1e-7] * 5 + [5e-4, 2e-6, 9e-3]) == []
    # bf16 noise within 10x of its level
    assert warned_steps(GapWatch(), [0.01, 0.02, 0.012, 0.015, 0.05, 0.03, 0.09]) == []
    assert warned_steps(GapWatch(), [0.01] * 4 + [math.nan]) == [4]  # a NaN gap is always flagged
    with pytest.raises(ValueError, match="factor > 1"):
        GapWatch(factor=1.0)


def test_the_update_warns_on_rank_zero_only(caplog):
    def policy(rank_zero: bool):
        return SimpleNamespace(rollout_step=0, trainer=SimpleNamespace(is_global_zero=rank_zero))

    for rank_zero, expected in ((True, 1), (False, 0)):
        stub = policy(rank_zero)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sgrpo.train.update"):
            for step, gap in enumerate([0.003] * 4 + [0.7, 0.7]):
                stub.rollout_step = step
                PolicyUpdate._watch_gap(stub, gap)
        assert len([r for r in caplog.records if "stale weights" in r.getMessage()]) == expected
        assert stub._gap_watch.warned_at == 4  # every process keeps the same state; rank 0 speaks
