"""model.balance_batch's placement (sgrpo/train/balance.py, sgrpo/train/exchange.py) on one process: the
equal-size Karmarkar-Karp partition by hand and against a brute-force optimum, verl 0.6.1's placement and
micro_batch_token_mean weights against an independent reference written from verl's rules, and the refusals.
The 2-process exchange (gradients equal to the unbalanced run, a process that raises) is in test_sharded.py."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

import pytest
import torch

from estimators import GRPO
from sgrpo.train.balance import balanced_partitions, imbalance, karmarkar_karp, place, verl_order, verl_workload
from sgrpo.train.exchange import BalancedRows, _rebuild, balance_mode
from sgrpo.train.loss import loss_groups, token_weights
from sgrpo.types import RolloutBatch
from tasks.environment import Environment


def test_equal_size_partition_by_hand():
    """[1, 2, 3, 4] in 2 sets of 2: tuples (1, 2) and (3, 4), spreads 1 and 1; the one whose largest set is larger
    (4) goes first and takes the other's smallest set: {4, 1} and {3, 2}; the sets in descending order of
    (sum, size, items): {3, 2} (items [(3, 4), ...]) before {2, 1}."""
    assert karmarkar_karp([1, 2, 3, 4], 2) == [[3, 0], [2, 1]]
    assert balanced_partitions([1, 2, 3, 4], 2) == [[0, 3], [1, 2]]
    # 6 items in 3 sets: tuples (1, 2, 3) and (10, 20, 30): {30, 1}, {20, 2}, {10, 3}
    assert sorted(map(sorted, karmarkar_karp([1, 2, 3, 10, 20, 30], 3))) == [[0, 5], [1, 4], [2, 3]]


def test_unequal_partition_is_the_differencing_heuristic():
    """{8, 7, 6, 5, 4} in 2 sets: differences 8-7 = 1, 6-5 = 1, then 4 against 1 (3), 3 against 1: spread 2,
    where {8, 7} / {6, 5, 4} has 0 (Karmarkar-Karp is not optimal)."""
    sets = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in s) for s in sets)
    assert sums == [14, 16]


def test_layout_small_large_small():
    """verl orders each process's rows by workload: even positions ascending, then odd positions descending."""
    assert verl_order([0, 1, 2, 3, 4], [5, 1, 4, 2, 3]) == [1, 4, 0, 2, 3]  # costs 1, 3, 5, 4, 2
    assert verl_order([2, 0], [7, 1, 7]) == [0, 2]  # ties by index
    assert verl_workload(10) == 245860


def brute_force_largest(costs: list[int], k: int) -> int:
    """The smallest possible largest set sum over every partition of ``costs`` into k sets of equal size."""
    n, best = len(costs), None
    size = n // k

    def split(items: tuple[int, ...], sets: int):
        if sets == 1:
            yield [items]
            return
        first, rest = items[0], items[1:]
        for others in itertools.combinations(rest, size - 1):
            remaining = tuple(i for i in rest if i not in others)
            for tail in split(remaining, sets - 1):
                yield [(first, *others), *tail]

    for sets in split(tuple(range(n)), k):
        largest = max(sum(costs[i] for i in s) for s in sets)
        best = largest if best is None else min(best, largest)
    return best


def test_against_the_brute_force_optimum():
    """Random small inputs (4-9 items, 2 or 3 equal sets): a valid equal-size partition whose spread is at most
    the largest item less the smallest (each merge keeps the spread within the tuples' spread), its largest set at
    most that above the optimum's; it finds the optimum in most cases (165 of these 200)."""
    rng, optimal = random.Random(0), 0
    for _ in range(200):
        k = rng.choice([2, 3])
        n = k * rng.randint(2, 3)
        costs = [rng.randint(1, 50) for _ in range(n)]
        sets = karmarkar_karp(costs, k)
        assert sorted(i for s in sets for i in s) == list(range(n)) and {len(s) for s in sets} == {n // k}
        sums = [sum(costs[i] for i in s) for s in sets]
        assert sums == sorted(sums, reverse=True)
        best = brute_force_largest(costs, k)
        assert best <= max(sums) <= best + max(costs) - min(costs)
        assert max(sums) - min(sums) <= max(costs) - min(costs)
        optimal += max(sums) == best
    assert optimal == 165


def test_place_pads_to_a_multiple_and_imbalance():
    shares = place([5, 1, 4, 2, 3], 2, verl_layout=False)
    assert sorted(len(s) for s in shares) == [2, 3] and sorted(sum(shares, [])) == [0, 1, 2, 3, 4]
    assert place([], 2, True) == [[], []]
    assert imbalance([3.0, 1.0]) == 1.5 and imbalance([0.0, 0.0]) == 1.0


def test_place_leaves_no_process_empty_when_real_items_cost_nothing():
    """Fillers sorted after real zero-cost items (dropped groups, zero-advantage rows) could meet in one set: with 4
    processes and 5 groups, two of them dropped, process 3 got nothing (and a multi-turn update then raised on its
    empty trajectories). Sizes differ by at most one, on random costs with many zeros."""
    assert sorted(len(s) for s in place([0.0, 0.0, 5.0, 7.0, 9.0], 4, verl_layout=False)) == [1, 1, 1, 2]
    for seed in range(500):
        rng = random.Random(seed)
        world = rng.randint(2, 6)
        costs = [rng.choice([0.0, 0.0, float(rng.randint(1, 9))]) for _ in range(rng.randint(world, 4 * world))]
        shares = place(costs, world, verl_layout=bool(seed % 2))
        assert sorted(sum(shares, [])) == list(range(len(costs))), seed
        assert max(map(len, shares)) - min(map(len, shares)) <= 1, (seed, shares)


# ---------------------------------------------------------------- verl's placement, an independent reference
def reference_balance(lengths: list[int], world: int) -> list[list[int]]:
    """verl 0.6.1's ``_balance_batch`` from its rules (not sgrpo's code): workload 24576 L + L^2; the largest
    differencing method on k-tuples of the items sorted by (workload, index), a partial solution a list of k
    [sum, items] sets sorted descending by (sum, size, items), the one of largest spread (ties: the larger largest
    set) merged first with the next, largest set to smallest; set i to rank i; each rank's rows sorted by
    (workload, index), even positions then odd ones reversed."""
    work = [24576 * n + n * n for n in lengths]
    ordered = sorted((w, i) for i, w in enumerate(work))
    key = lambda s: (s[0], len(s[1]), s[1])  # noqa: E731

    def tidy(sets):
        return sorted(sets, key=key, reverse=True)

    def before(a, b):  # verl's State.__lt__: the larger spread first, then the larger largest set
        sa, sb = a[0][0] - a[-1][0], b[0][0] - b[-1][0]
        if sa != sb:
            return -1 if sa > sb else 1
        return -1 if key(a[0]) > key(b[0]) else 1

    states = [tidy([[w, [(i, w)]] for w, i in ordered[j : j + world]]) for j in range(0, len(ordered), world)]
    while len(states) > 1:
        states.sort(key=functools.cmp_to_key(before))
        a, b = states.pop(0), states.pop(0)
        states.append(tidy([[a[i][0] + b[-1 - i][0], a[i][1] + b[-1 - i][1]] for i in range(world)]))
    ranks = []
    for _, items in states[0]:
        ranked = sorted((i for i, _ in items), key=lambda i: (work[i], i))
        ranks.append(ranked[::2] + ranked[1::2][::-1])
    return ranks


def reference_weights(lengths: list[int], loss_tokens: list[int], world: int, rows: int) -> dict[int, float]:
    """Each row's token weight under verl's token-mean: its rank's chunk cut into micro-batches of ``rows`` rows in
    order, each a token mean, scaled by 1 / (micro-batches per rank), averaged over ranks."""
    weights = {}
    for chunk in reference_balance(lengths, world):
        micro = [chunk[i : i + rows] for i in range(0, len(chunk), rows)]
        for batch in micro:
            tokens = sum(loss_tokens[i] for i in batch)
            for i in batch:
                weights[i] = 1.0 / (tokens * len(micro) * world)
    return weights


def process_batch(lengths: list[int], prompt: int, group_size: int, first_token: int) -> RolloutBatch:
    """A single-turn batch whose rows hold ``prompt`` prompt tokens and ``lengths`` completion tokens."""
    n, t = len(lengths), max(lengths)
    ids = torch.arange(first_token, first_token + n).unsqueeze(-1).repeat(1, prompt + t)
    completion = torch.arange(t) < torch.tensor(lengths).unsqueeze(-1)
    attention = torch.cat([torch.ones(n, prompt, dtype=torch.long), completion.long()], 1)
    return RolloutBatch(ids, attention, completion, [f"c{first_token + i}" for i in range(n)],
                        torch.zeros(n, dtype=torch.bool), group_size,
                        logprobs=-completion.float() * torch.arange(first_token, first_token + n).unsqueeze(-1),
                        versions=torch.arange(n) + first_token)  # fmt: skip


class Placing(BalancedRows):
    mask_truncated = False


def test_rows_mode_reproduces_verls_placement_and_token_mean_weights():
    """2 processes of 2 groups of 4 (lengths skewed: process 0 long, process 1 short), micro-batches of 2 rows:
    each process's rows, their order, and micro_batch_token_mean's per-token weights (``loss_groups`` over the
    process's rows in order, ``token_weights``) are the reference's; everything per row travels with the row."""
    lengths = [[9, 7, 12, 3, 11, 8, 10, 6], [2, 4, 1, 5, 3, 2, 6, 1]]
    prompt, g, world, rows = 3, 4, 2, 2
    batches = [process_batch(lengths[p], prompt, g, 100 * (p + 1)) for p in range(world)]
    adv = torch.arange(16, dtype=torch.float32) / 10
    keep = torch.ones(16, dtype=torch.bool)
    flat = lengths[0] + lengths[1]
    expected = reference_balance([prompt + n for n in flat], world)
    weights = reference_weights([prompt + n for n in flat], flat, world, rows)
    shares = [Placing()._share("rows", batches, adv, keep, rank) for rank in range(world)]
    groups = sum(loss_groups(s[0].completion_mask.sum(-1), rows)[1] for s in shares)
    for rank, (own, own_adv, own_keep, logs) in enumerate(shares):
        global_rows = [int(i) % 100 + 8 * (int(i) // 100 - 1) for i in own.input_ids[:, 0]]
        assert global_rows == expected[rank] and len(global_rows) == 8
        assert own.group_size == 1 and own_adv.shape == (8, 1) and own_keep.all()
        assert own_adv[:, 0].tolist() == adv[global_rows].tolist()
        assert own.versions.tolist() == own.input_ids[:, 0].tolist()  # versions moved with their rows
        assert own.completions == [f"c{int(i)}" for i in own.input_ids[:, 0]]
        assert own.completion_mask.sum(-1).tolist() == [flat[i] for i in global_rows]
        mask = own.completion_mask
        group_tokens, _ = loss_groups(mask.sum(-1), rows)
        w = token_weights(mask, "micro_batch_token_mean", 0, 0, 0, group_tokens, groups)
        for j, i in enumerate(global_rows):
            assert w[j, 0].item() == pytest.approx(weights[i], rel=1e-6)
        # real tokens of process 0: 66 + 24 prompt, process 1: 24 + 24; after: within one token of even
        assert logs["train/update/token_imbalance_before"] == pytest.approx(90 / 69)
        assert logs["train/update/token_imbalance_after"] <= 70 / 69


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_exchange_carries_advantages_in_their_own_dtype(dtype):
    """What one process sends (``_exchanged_payload``) rebuilt as the others rebuild it (``_rebuild``; the gather
    itself is the 2-process launch's, tests/test_sharded.py): advantages keep their dtype and bits (a float64 run
    stays float64, as without balancing), rows and keep flags unchanged."""
    batch = process_batch([3, 1, 2, 4], 2, 2, 10)
    adv = (torch.tensor([[1.0, -1.0], [0.1, -0.1]], dtype=torch.float64) / 3).to(dtype)
    keep = torch.tensor([True, False])
    tensors, objects = Placing()._exchanged_payload(batch, adv, keep)
    (rebuilt,), got, got_keep = _rebuild(batch, [[t] for t in tensors], [objects])
    assert got.dtype == dtype and torch.equal(got, adv.reshape(-1))
    assert got_keep.tolist() == [True, True, False, False]
    assert torch.equal(rebuilt.input_ids, batch.input_ids) and rebuilt.completions == batch.completions


def test_groups_mode_moves_whole_groups_evenly():
    """"groups": whole groups (their advantages and keep flags with them), as many on every process, the heavy
    groups apart; the token imbalance falls."""
    lengths = [[9, 7, 12, 3, 11, 8, 10, 6], [2, 4, 1, 5, 3, 2, 6, 1]]
    batches = [process_batch(lengths[p], 3, 4, 100 * (p + 1)) for p in range(2)]
    adv, keep = torch.arange(16, dtype=torch.float32), torch.tensor([True] * 12 + [False] * 4)

    class Groups(Placing):
        model = type("M", (), {"config": type("C", (), {"hidden_size": 8})()})()
        _packs = _shares = staticmethod(lambda model: True)

    shares = [Groups()._share("groups", batches, adv, keep, rank) for rank in range(2)]
    seen = []
    for own, own_adv, own_keep, logs in shares:
        assert own.group_size == 4 and own.num_groups == 2 and own_adv.shape == (2, 4) and own_keep.shape == (2,)
        firsts = own.input_ids[::4, 0].tolist()
        seen += firsts
        for b, first in enumerate(firsts):
            row = first % 100 + 8 * (first // 100 - 1)
            assert own_adv[b].tolist() == adv[row : row + 4].tolist() and bool(own_keep[b]) == bool(keep[row])
        assert logs["train/update/token_imbalance_after"] < logs["train/update/token_imbalance_before"]
    assert sorted(seen) == [100, 104, 200, 204]
    assert {100, 104} not in [set(s[0].input_ids[::4, 0].tolist()) for s in shares]  # the long groups apart


def test_groups_cost_a_shared_prompt_once_per_part_under_a_row_limit():
    """With ``micro_batch_size`` the update still runs a group's prompt once per part of at most that many rows; the
    exchange priced each row with a prompt of its own, so a long-prompt group weighed up to G / parts times what it
    costs. A group of 4 rows (one prompt of 30 tokens, completions of 5) in parts of 2: two sequences of 30 + 4 + 4
    positions (a completion's last token is predicted, not run), a forward and backward (3 units) each."""
    from sgrpo.model.rows import sequence_cost

    one_prompt = process_batch([5, 5, 5, 5], 30, 4, 100)
    ids = one_prompt.input_ids.clone()
    ids[:, :30] = 7  # the group's one prompt
    batch = dataclasses.replace(one_prompt, input_ids=ids)

    class Limited(Placing):
        model = type("M", (), {"config": type("C", (), {"hidden_size": 8})()})()
        micro_batch_size = 2
        _packs = _shares = staticmethod(lambda model: True)

    runs = batch.completion_mask.any(-1)
    costs = Limited()._group_costs(batch, [[0, 1, 2, 3]], batch.completion_mask, runs)
    assert costs == [pytest.approx(3 * 2 * sequence_cost(38, 8))]  # was 3 x 4 x sequence_cost(34, 8): 1.71x


class Env(Environment):
    max_turns = 2

    def reset(self, example):  # pragma: no cover - never run
        return []

    def step(self, state, text):  # pragma: no cover
        return None


def test_refusals_in_one_line():
    assert balance_mode(None) is None and balance_mode(False) is None and balance_mode(True) == "rows"
    with pytest.raises(ValueError, match="model.balance_batch must be null/false, 'rows'"):
        balance_mode("yes")
    from tests.engine_helpers import FixedRollout
    from tests.test_policy_gradients import make_policy

    rollout = process_batch([1, 2], 1, 2, 0)
    with pytest.raises(ValueError, match="'rows' moves single rows, which would split a multi-turn trajectory"):
        policy = make_policy("unused", rollout, GRPO(), balance_batch="rows", environment=Env.__new__(Env))
    policy = make_policy("unused", rollout, GRPO(), balance_batch="groups")
    assert policy.balance_batch == "groups" and isinstance(policy.rollout, FixedRollout)


def test_episodes_send_their_trajectories_whether_or_not_they_continued_in_new_rows():
    """``balance_batch: groups`` with an environment: one process's episodes all ended in one row each (no
    trajectory of its own), another's continued in a new row. Each sends the same tensors (before: one fewer, and
    the all-gathers mismatched: gloo aborted, NCCL would hang), and the rebuilt batches keep every row's
    trajectory."""
    from sgrpo.rollout.hf import HFRollout
    from tasks.environment import Environment, Observation
    from tests.multiturn_helpers import EXAMPLES, STRIP, chat_model, chat_tokenizer

    class Turns(Environment):
        def __init__(self, more: bool) -> None:
            super().__init__(max_turns=2)
            self.more = more

        def step(self, example, messages):
            return Observation([{"role": "user", "content": "go on"}] if self.more else [], done=not self.more)

    tokenizer = chat_tokenizer(STRIP)
    model = chat_model(tokenizer)
    rollouts = []
    for more in (True, False):
        torch.manual_seed(0)
        rollouts.append(HFRollout(max_new_tokens=8).generate_episodes(model, tokenizer, EXAMPLES, 2, Turns(more)))
    assert rollouts[0].trajectory is not None and rollouts[1].trajectory is None  # the case: forked on one only
    adv, keep = torch.zeros(2, 2), torch.ones(2, dtype=torch.bool)
    sent = [BalancedRows._exchanged_payload(None, r, adv, keep) for r in rollouts]
    assert len(sent[0][0]) == len(sent[1][0]) and sent[0][1]["present"] == sent[1][1]["present"]
    gathered = [list(column) for column in zip(sent[0][0], sent[1][0])]  # what all_gather_rows hands every process
    batches, _, _ = _rebuild(rollouts[0], gathered, [objects for _, objects in sent])
    for batch, rollout in zip(batches, rollouts):
        assert torch.equal(batch.row_trajectory(), rollout.row_trajectory())
        assert torch.equal(batch.input_ids, rollout.input_ids)
