"""Epochs as the stopping rule (``trainer.max_epochs`` with ``max_steps`` -1): an epoch is one pass over the train
split's distinct prompts on every process, and a fit resumes mid-epoch and at an epoch's end as if never stopped."""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path

import pytest

from sgrpo.fit import main
from sgrpo.run.data import EpochStepBatches, RefillStream, StepBatches, stopping_rule_error
from sgrpo.types import Example

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = [Example(f"p{i}", str(i)) for i in range(10)]


def prompts(stream: StepBatches, steps) -> list[list[str]]:
    return [[ex.prompt for ex in stream.batch(step)] for step in steps]


def test_an_epoch_is_one_pass_over_the_distinct_prompts_on_every_process():
    """10 prompts, 4 per step: ceil(10 / 4) = 3 steps per epoch, the third completed by the epoch's first 2; each
    epoch its own permutation; 2 processes split every step and, together, see each epoch's prompts."""
    one = EpochStepBatches(EXAMPLES, 4, seed=3)
    assert len(one) == 3
    for epoch in range(3):
        steps = prompts(one, range(3 * epoch, 3 * epoch + 3))
        seen = [p for step in steps for p in step]
        assert sorted(set(seen)) == sorted(ex.prompt for ex in EXAMPLES) and len(seen) == 12
        assert steps[2][2:] == steps[0][:2]  # the repeated two: the epoch's first
    assert prompts(one, range(3)) != prompts(one, range(3, 6))  # a fresh order per epoch
    ranks = [EpochStepBatches(EXAMPLES, 4, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for step in range(6):
        halves = [p for rank in ranks for p in prompts(rank, [step])[0]]
        assert sorted(halves) == sorted(prompts(one, [step])[0]) and all(len(prompts(r, [step])[0]) == 2 for r in ranks)
    # an iteration is the rest of an epoch: from a resumed step, then epoch by epoch
    resumed = EpochStepBatches(EXAMPLES, 4, seed=3, start_step=4)
    assert [[ex.prompt for ex in b] for b in resumed] == prompts(one, [4, 5])
    assert [[ex.prompt for ex in b] for b in resumed] == prompts(one, [6, 7, 8])


def test_the_stream_holds_its_epoch_order_in_8_bytes_a_prompt():
    """The epoch's order was a list of Python ints (40 bytes a prompt: 46 MiB for OpenThoughts' 1.2M rows, in each
    of a process's streams); the same order, as int64."""
    import tracemalloc

    import torch

    examples = [Example("p", "a")] * 200_000
    stream = StepBatches(examples, 4, seed=3)
    tracemalloc.start()
    stream.batch(0)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held < 200_000 * 8 // 4, held  # torch's storage is not traced: the order's Python objects are gone
    generator = torch.Generator().manual_seed(3 * 1_000_003)
    order = torch.randperm(len(examples), generator=generator).tolist()  # the order itself: unchanged
    assert [stream._index(p) for p in range(5)] == order[:5]


def test_a_step_spanning_two_epochs_holds_no_prompt_twice_and_each_epoch_every_prompt_once():
    """max_steps' stream: 10 prompts, 4 and 7 per step, so steps span epochs; the step's prompts are distinct (the
    next epoch's order starts past the prompts its end took), each epoch's 10 positions still hold every prompt once,
    epoch 0 is the seeded permutation itself, and a stream resumed at any step, or split over 2 processes, agrees."""
    import torch

    for b in (4, 7):
        one = StepBatches(EXAMPLES, b, seed=3)
        steps = prompts(one, range(14))
        assert all(len(set(step)) == b for step in steps), steps
        flat = [p for step in steps for p in step]
        for epoch in range(len(flat) // 10):
            assert sorted(flat[10 * epoch : 10 * epoch + 10]) == sorted(ex.prompt for ex in EXAMPLES)
        generator = torch.Generator().manual_seed(3 * 1_000_003)
        assert flat[:10] == [EXAMPLES[i].prompt for i in torch.randperm(10, generator=generator).tolist()]
        for start in (0, 5, 11):
            resumed = StepBatches(EXAMPLES, b, seed=3, start_step=start)
            assert prompts(resumed, [start, start + 1]) == steps[start : start + 2]
        ranks = [StepBatches(EXAMPLES, b + b % 2, seed=3, rank=r, world_size=2) for r in (0, 1)]
        whole = StepBatches(EXAMPLES, b + b % 2, seed=3)
        for step in range(12):
            assert sorted(p for r in ranks for p in prompts(r, [step])[0]) == sorted(prompts(whole, [step])[0])
    assert [len(step) for step in prompts(StepBatches(EXAMPLES[:3], 4, seed=3), range(3))] == [4, 4, 4]


def test_readers_epochs_apart_find_their_orders_without_rebuilding_the_chain():
    """The server producer asks for step s + S + 1 while the loader asks for s + 1, from one stream: with 100 prompts
    and 64 a step these are epochs apart, and only the last two epochs were kept, so every other call rebuilt the
    chain from epoch 0 (a second a call at step 20,000). The orders are a fresh stream's."""
    examples = [Example(f"p{i}", str(i)) for i in range(100)]
    stream, raws = StepBatches(examples, 64, seed=3), []
    original = stream._raw
    stream._raw = lambda epoch: raws.append(epoch) or original(epoch)
    stream.indices(2_000)  # the chain's walk to epoch 1,280 (a resume there makes the same)
    raws.clear()
    got = {}
    for step in range(2_000, 2_010):
        got[step + 6], got[step] = stream.indices(step + 6), stream.indices(step)
    assert len(raws) <= 10, len(raws)  # one new epoch at a time, about 6 in 10 steps
    fresh = StepBatches(examples, 64, seed=3)  # one reader, in order
    assert all(got[step] == fresh.indices(step) for step in sorted(got))
    few = StepBatches(examples[:8], 8, seed=3)  # an epoch a step: the orders kept are bounded in number too
    few.indices(500)
    assert len(few._perms) <= StepBatches.KEPT_EPOCHS


def test_refills_draw_the_prompts_their_step_has_not_drawn_on_every_process_and_resume_the_same():
    """Dynamic sampling's refill rounds of a step (both processes' shares, in its positions' order) hold none of the
    step's prompts nor each other's until the step has drawn all 10, then go on over all of them; a fresh stream
    (a resume) asked for a later round only draws the same; a data set smaller than a step still refills."""
    for kind in (StepBatches, EpochStepBatches):
        ranks = [RefillStream(kind(EXAMPLES, 4, seed=3, rank=r, world_size=2), seed=3) for r in (0, 1)]
        for step in range(6):
            drawn = {EXAMPLES[i].prompt for i in ranks[0].stream.indices(step)}
            shares = [[ex.prompt for ex in refill.batch(step, k)] for k in (1, 2, 3) for refill in ranks]
            assert all(len(share) == 2 for share in shares)
            order = [p for pair in zip(sum(shares[0::2], []), sum(shares[1::2], [])) for p in pair]
            fresh = order[: len(EXAMPLES) - len(drawn)]
            assert len(set(fresh)) == len(fresh) and drawn.isdisjoint(fresh), (step, drawn, order)
            assert drawn | set(fresh) == {ex.prompt for ex in EXAMPLES}
            resumed = RefillStream(kind(EXAMPLES, 4, seed=3, rank=1, world_size=2), seed=3)
            assert [ex.prompt for ex in resumed.batch(step, 3)] == shares[5]
    small = RefillStream(StepBatches(EXAMPLES[:3], 4, seed=3), seed=3)
    assert [len(small.batch(0, k)) for k in (1, 2, 3)] == [4, 4, 4]


def test_neither_steps_nor_epochs_is_refused_in_one_line_naming_both():
    assert stopping_rule_error(-1, None) == (
        "set trainer.max_steps (training steps) or trainer.max_epochs (passes over the train split's distinct "
        "prompts, with max_steps -1): neither bounds the run"
    )
    assert stopping_rule_error(None, -1) is not None
    assert stopping_rule_error(0, 5) == "trainer.max_steps must be >= 1, or -1 / unset for no limit, got 0"
    assert stopping_rule_error(-1, 0) == "trainer.max_epochs must be >= 1, or -1 / unset for no limit, got 0"
    assert stopping_rule_error(-1, 5) is None and stopping_rule_error(10, None) is None
    assert stopping_rule_error(10, 2) is None  # whichever comes first


def _fit(root: Path, *extra: str):
    return main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        "--model.task.init_args.num_train=10", "--trainer.val_check_interval=100",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.log_completions_every=1", "--model.log_completions_groups=4",
        *extra,
    ])  # fmt: skip


@pytest.mark.slow
def test_an_epoch_bounded_fit_stops_after_its_passes_and_resumes_mid_epoch(tmp_path):
    """10 prompts, 4 per step (3 steps per epoch): stopped at step 2 (mid-epoch, by max_steps), resumed with
    max_epochs 1 it takes the epoch's last step and stops (3 steps: one pass); resumed with max_epochs 2 from that
    epoch's end it takes epoch 2's 3 steps. Every step is logged once, and every epoch trains on each prompt."""
    _fit(tmp_path, "--trainer.max_steps=2", "--trainer.max_epochs=2")
    one = _fit(tmp_path, "--trainer.max_steps=-1", "--trainer.max_epochs=1", "--ckpt_path=last")
    assert one.model.rollout_step == 3 and one.trainer.current_epoch == 1
    two = _fit(tmp_path, "--trainer.max_steps=-1", "--trainer.max_epochs=2", "--ckpt_path=last")
    assert two.model.rollout_step == 6
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step", r.get("resumed_at")) for r in records] == [0, 1, 2, 2, 3, 3, 4, 5]  # resumed_at 2, 3
    by_step: dict[int, set[str]] = defaultdict(set)
    for line in (tmp_path / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]].add(row["prompt"])
    train = {ex.prompt for ex in two.model.task.examples("train")}
    assert len(train) == 10 and sorted(by_step) == list(range(6))
    for epoch in (0, 1):
        assert set().union(*(by_step[s] for s in range(3 * epoch, 3 * epoch + 3))) == train, epoch
    stream = EpochStepBatches(list(two.model.task.examples("train")), 4, seed=0)  # the policy's seed
    assert [by_step[s] for s in range(6)] == [{ex.prompt for ex in stream.batch(s)} for s in range(6)]


def test_an_iteration_starts_at_its_cursor_and_an_epoch_holds_the_limits_steps():
    """Lightning starts an iteration per epoch and stops one early under limit_train_batches: the stream's cursor
    (the policy's steps done) says where the next starts. Under a limit of S steps an epoch is S steps over the
    first S x B prompts of its order, and the next epoch starts a fresh order."""
    done = [0]
    endless = StepBatches(EXAMPLES, 4, seed=3, start_step=lambda: done[0])
    reference = StepBatches(EXAMPLES, 4, seed=3)
    taken = iter(endless)
    next(taken), next(taken), next(taken)  # steps 0, 1 trained, 2 pulled ahead and dropped
    done[0] = 2
    assert [next(iter(endless)) for _ in range(1)] == [reference.batch(2)]  # before: batch(0), trained again
    copy = pickle.loads(pickle.dumps(endless))  # an async producer's copy: without the policy's cursor
    assert copy._cursor is None and copy.batch(5) == reference.batch(5) and next(iter(copy)) == reference.batch(2)
    full = EpochStepBatches(EXAMPLES, 4, seed=3)
    limited = EpochStepBatches(EXAMPLES, 4, seed=3, start_step=lambda: done[0], limit_batches=2)
    half = EpochStepBatches(EXAMPLES, 4, seed=3, limit_batches=0.5)
    assert limited.steps_per_epoch == 2 and half.steps_per_epoch == 1
    assert len(limited) == len(full) == full.steps_per_epoch  # Lightning applies its limit to len() itself
    done[0] = 0
    assert [b for b in limited] == [full.batch(0), full.batch(1)]  # the epoch's first 2 x 4 prompts of its order
    done[0] = 2
    epoch_1 = [[ex.prompt for ex in b] for b in limited]  # before: the rest of epoch 0 (its step 2), then stopped
    assert epoch_1 == prompts(full, [3, 4]) and len({p for step in epoch_1 for p in step}) == 8


@pytest.mark.slow
@pytest.mark.parametrize(("bound", "limit"), [("--trainer.max_steps=4", "2"), ("--trainer.max_epochs=2", "2"),
                                             ("--trainer.max_epochs=2", "0.67")])  # fmt: skip
def test_a_fit_under_limit_train_batches_trains_each_steps_own_prompts(bound, limit, tmp_path):
    """limit_train_batches=2 of 3 steps an epoch (or 0.67 of them). Bounded by steps, Lightning's second epoch trained
    steps 0 and 1's prompts again as steps 2 and 3 (a resume at step 2 would take others); bounded by 2 epochs, the
    second epoch took the first's leftover step and stopped: 3 steps, not 4; and a fraction was applied twice (the
    stream's length was already the limited one): 2 steps."""
    steps = bound == "--trainer.max_steps=4"
    cli = _fit(tmp_path, bound, *(["--trainer.max_epochs=-1"] if steps else ["--trainer.max_steps=-1"]),
               f"--trainer.limit_train_batches={limit}")  # fmt: skip
    assert cli.model.rollout_step == 4
    by_step: dict[int, set[str]] = defaultdict(set)
    for line in (tmp_path / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]].add(row["prompt"])
    examples = list(cli.model.task.examples("train"))
    stream = StepBatches(examples, 4, seed=0) if steps else EpochStepBatches(examples, 4, seed=0, limit_batches=2)
    assert [by_step[s] for s in range(4)] == [{ex.prompt for ex in stream.batch(s)} for s in range(4)]
