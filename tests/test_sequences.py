"""A multi-turn trajectory is one sequence to the loss's aggregation (``sgrpo.train.sequences``), against hand-computed
values; single-turn nothing changes. The end-to-end gradients: tests/test_episodes_training.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgrpo.train.loss import token_weights
from sgrpo.train.sequences import minibatch_rows, sequence_budget, sequence_tokens, trajectory_count

#: 6 rows of 4 trajectories: trajectory 0 forked into rows 0 and 1, trajectory 2 into rows 3, 4; row 5 carries no loss
TRAJECTORY = torch.tensor([0, 0, 1, 2, 2, 3])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()
ROWS = torch.tensor([0, 1, 2, 3, 4])  # the rows that carry loss


def test_a_trajectory_counts_once_and_its_rows_share_its_token_count():
    assert trajectory_count(ROWS, TRAJECTORY) == 3 and trajectory_count(ROWS, None) == 5
    assert sequence_tokens(MASK, ROWS, TRAJECTORY).tolist() == [5, 5, 4, 2, 2, 0]  # 3 + 2, 4, 1 + 1
    assert sequence_tokens(MASK, ROWS, None) is None
    assert sequence_tokens(MASK, torch.tensor([1, 3]), TRAJECTORY).tolist() == [0, 2, 0, 1, 0, 0]  # what rows hold


def test_seq_mean_token_mean_weighs_a_token_by_its_trajectory():
    """1 / (B |o_j|): B = 3 trajectories, |o_0| = 5, |o_1| = 4, |o_2| = 2; each trajectory's weights sum to 1 / B."""
    weights = token_weights(MASK, "seq_mean_token_mean", 3, 11, 4, sequence_tokens=sequence_tokens(MASK, ROWS,
                                                                                                    TRAJECTORY))
    assert torch.allclose(weights[0, 0], torch.tensor(1 / 15)) and torch.allclose(weights[3, 0], torch.tensor(1 / 6))
    per_trajectory = torch.zeros(4).index_add_(0, TRAJECTORY, weights.sum(-1))
    assert torch.allclose(per_trajectory, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0]))
    rows = token_weights(MASK, "seq_mean_token_mean", 5, 11, 4)  # the old row-based weights: rows of their own
    assert torch.allclose(rows[3, 0], torch.tensor(1 / 5))  # a one-token row weighed as a whole sequence


def test_dr_grpo_s_constant_is_the_most_a_trajectory_can_generate():
    assert sequence_budget(16) == 16 and sequence_budget(16, SimpleNamespace(max_turns=3), episodes=False) == 16
    assert sequence_budget(16, SimpleNamespace(max_turns=3, max_episode_tokens=None), episodes=True) == 48
    assert sequence_budget(16, SimpleNamespace(max_turns=3, max_episode_tokens=40), episodes=True) == 40


def test_minibatches_keep_a_trajectory_s_rows_together():
    parts = minibatch_rows(ROWS, TRAJECTORY, torch.tensor([2, 0, 1]), 2)  # trajectories 2, 0 | 1
    assert [p.tolist() for p in parts] == [[3, 4, 0, 1], [2]]
    assert [p.tolist() for p in minibatch_rows(ROWS, TRAJECTORY, None, 3)] == [[0, 1], [2], [3, 4]]
    order = torch.tensor([4, 0, 3, 1, 2])  # single-turn: exactly the row-based cut
    expected = ROWS[order].tensor_split(2)
    assert all(torch.equal(a, b) for a, b in zip(minibatch_rows(ROWS, None, order, 2), expected))


def test_a_process_left_without_rows_counts_no_sequence_tokens():
    """The exchange can leave a process no rows (an empty trajectory tensor): ``trajectory.max()`` raised there."""
    empty = torch.zeros(0, dtype=torch.long)
    out = sequence_tokens(torch.zeros(0, 4, dtype=torch.bool), empty, empty)
    assert out.shape == (0,) and out.dtype == torch.float32
