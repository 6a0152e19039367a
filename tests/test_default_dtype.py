"""Under ``trainer.precision: bf16-true`` Lightning makes bfloat16 torch's default dtype inside ``training_step``:
every tensor built there without a dtype is bf16, which holds integers exactly only up to 256 and about three
significant digits. Counts, sums of metrics, sampler log-probs and the micro-batch count that every process must
agree on are built in float32 (float64 for that count) whatever the default."""

from __future__ import annotations

import contextlib

import torch

from sgrpo.distributed import max_over_processes
from sgrpo.rollout.episodes import _batch, _Row, _Trajectory
from sgrpo.types import Example


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class OneProcess:
    root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op):
        return tensor


def test_the_micro_batch_count_every_process_agrees_on_is_exact():
    """257 micro-batches used to read 256 in bf16: that process ran one backward more than the others pad to,
    and FSDP2's collectives no longer paired up."""
    with default_dtype(torch.bfloat16):
        assert [max_over_processes(OneProcess(), n) for n in (255, 257, 1001)] == [255, 257, 1001]


class Tokens:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


def test_multi_turn_rows_keep_the_sampler_s_log_probs_in_float32():
    """The behaviour log-probs of a multi-turn rollout (the importance weights' denominator) were rounded to bf16."""
    row = _Row(prompt=[1, 2])
    row.extend([3, 4, 5], generated=True, logprobs=[-0.123456789, -1.000001, -2.5e-7], masses=[0.9999, 1.0, 0.3333333])
    trajectory = _Trajectory(Example("p", "a"), [], {}, [row], "", final=[3, 4, 5])
    with default_dtype(torch.bfloat16):
        batch = _batch(Tokens(), [trajectory], group_size=1, pad=0, device="cpu", reports=(True, True))
    expected = torch.tensor([[-0.123456789, -1.000001, -2.5e-7]], dtype=torch.float32)
    assert batch.logprobs.dtype == torch.float32 and torch.equal(batch.logprobs, expected)
    assert torch.equal(batch.nucleus_mass, torch.tensor([[0.9999, 1.0, 0.3333333]], dtype=torch.float32))


def test_the_update_s_sums_and_counts_are_float32_under_bf16_true(monkeypatch):
    """The update's token count and metric sums (entropy, clip fractions, loss) were bf16 accumulators: a count past
    256 rounded, and each micro-batch's sum added to a bf16 total lost digits."""
    from estimators import GRPO
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from sgrpo.train.update import PolicyUpdate
    from tasks.synthetic import SyntheticTask
    from tests.engine_helpers import run_steps
    from tests.test_async import SHIPPED

    seen = []
    means = PolicyUpdate._token_means

    def spy(self, sums, tokens):
        seen.append({name: value.dtype for name, value in sums.items()} | {"tokens": tokens.dtype})
        return means(self, sums, tokens)

    monkeypatch.setattr(PolicyUpdate, "_token_means", spy)
    task = SyntheticTask(kind="sort", levels=[3, 5], num_train=16, num_validation=4)
    policy = GRPOPolicy(SHIPPED, task, GRPO(), HFRollout(max_new_tokens=8), group_size=4, prompts_per_step=4)
    run_steps(policy, steps=1, precision="bf16-true")
    assert seen and all(dtype == torch.float32 for step in seen for dtype in step.values()), [
        {k: v for k, v in step.items() if v != torch.float32} for step in seen]


def test_the_lm_heads_fused_float32_accumulation_is_found_whatever_the_default_dtype():
    """The check whether addmm accumulates a bf16 product into a float32 tensor in place (``sgrpo.model.head``,
    cached per process) first runs in the first backward, inside ``training_step``: with a bf16 default its
    accumulator was bf16, the answer False, and every chunk of the head's weight gradient took the path that writes
    a ``[V, H]`` float32 product and adds it (the meta device stands in for CUDA, which has the fused kernel)."""
    from sgrpo.model.head import _fp32_accumulate

    _fp32_accumulate.cache_clear()
    try:
        expected = _fp32_accumulate("meta", torch.bfloat16)
        assert expected  # the meta device has addmm's out_dtype: the case at stake
        _fp32_accumulate.cache_clear()
        with default_dtype(torch.bfloat16):
            assert _fp32_accumulate("meta", torch.bfloat16) == expected
    finally:
        _fp32_accumulate.cache_clear()


def test_openthoughts_success_threshold_is_not_rounded_to_the_default_dtype():
    """bf16-true makes bf16 the default dtype in ``training_step``: a threshold built as a tensor there read 0.9 as
    0.8984375, so a reward of 0.899 counted as a success (and moved its group between difficulty buckets)."""
    from tasks.openthoughts import OpenThoughts

    task = OpenThoughts.__new__(OpenThoughts)  # the threshold alone: no data set
    task.success_threshold = 0.9
    with default_dtype(torch.bfloat16):
        assert task._reached(torch.tensor([0.899, 0.9, 1.0], dtype=torch.float32)).tolist() == [False, True, True]


def test_the_reward_failure_counts_are_exact():
    """511 of 512 rewards failed with reward_failure_share 1.0: bf16 read both counts as 512 and stopped the run,
    "the reward failed for 512 of 512 completions", though one scored (found by a review)."""
    from sgrpo.run.guards import RewardFailureWatch

    watch = RewardFailureWatch(share=1.0, steps=1)
    with default_dtype(torch.bfloat16):
        watch.observe(511.0, 512, OneProcess(), step=0)
        assert watch.pending is None and watch.streak == 0
        watch.observe(513.0, 513, OneProcess(), step=1)
    assert watch.pending is not None and "failed for 513 of 513 completions" in str(watch.pending)


class TwoEqualProcesses(OneProcess):
    """A reduce over two processes that hold the same values."""

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "sum"
        return tensor * 2


def test_the_logged_failure_count_is_every_processs():
    """train/reward/failures was each process's own count, which the logger averages: 1/world of the step's count
    under DDP (found by a review). The guard's sum over processes is what the step logs now."""
    from sgrpo.run.guards import RewardFailureWatch

    watch = RewardFailureWatch(share=1.0, steps=3)
    assert watch.observe(5.0, 16, TwoEqualProcesses(), step=0) == 10.0
    assert watch.observe(0.0, 16, OneProcess(), step=1) == 0.0
