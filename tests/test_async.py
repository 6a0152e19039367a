"""Asynchronous rollouts (issue 35): the producer process, admission-bounded staleness, its metrics and faults.

The fits use configs/tiny.yaml's shipped (trained) model: its rewards vary, so every step moves the weights and a
wrong version would show. The 2-process cases run in tests/test_sharded.py's joined launch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from estimators import SoftmaxGRPO
from sgrpo.eval.report import read_run_metrics
from sgrpo.fit import main
from sgrpo.model.logprobs import completion_logprobs
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.rollout.producer import DELAY_ENV, FAULT_ENV
from sgrpo.rollout.producer_process import ProducerError, admitted
from sgrpo.train.asynchronous import async_rollout_error
from sgrpo.train.update import PolicyUpdate
from sgrpo.types import RolloutBatch
from tasks.synthetic import SyntheticTask
from tests.engine_helpers import FixedRollout, run_steps
from tests.test_faults_processes import live_processes

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
SHIPPED = str(REPO / "sgrpo" / "assets" / "quickstart_model")
#: logged values that are timings (or made of them), and the async run's own metrics
TIMED = ("train/time/", "train/throughput/", "train/async/")


def fit(root: Path, *extra: str, steps: int = 3) -> dict:
    main(["--config", TINY, f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.val_check_interval=1000", *extra])  # fmt: skip
    return read_run_metrics(root)


def asynchronous(staleness: int) -> list[str]:
    return ["--model.async_rollout=true", f"--model.max_staleness={staleness}"]


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMED)}


def weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(str(root / "hf_model" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ----------------------------------------------------------------------------------------------- fast
def test_admission_admits_a_step_only_within_s_versions_of_the_trainer():
    """accepted + running < (S + v + 1) g with g groups a step: step s (its g groups at once) iff s <= v + S."""
    g = 4
    for s in range(6):
        for v in range(4):
            for S in range(3):
                accepted_and_running = (s + 1) * g  # steps 0 .. s - 1 accepted, step s's groups running
                assert admitted(s, v, S) == (accepted_and_running <= (S + v + 1) * g)
    assert admitted(0, 0, 0) and not admitted(1, 0, 0)  # staleness 0: the synchronous order
    assert admitted(3, 1, 2) and not admitted(4, 1, 2)


def test_sync_every_up_to_s_plus_1_is_exactly_what_keeps_every_step_reachable():
    """Weights pushed every k steps (after steps k, 2k, ...; the producer starts with version `start`): the trainer
    at version t needs step t's groups, admitted only under the newest pushed version w (t <= w + S). Every step
    is reachable, from any start step (a resume), iff k - 1 <= S, which is what ``async_rollout_error`` admits."""
    for S in range(4):
        for k in range(1, 7):
            reachable = all(
                admitted(t, max([start] + [p for p in range(start + 1, t + 1) if p % k == 0]), S)
                for start in range(k) for t in range(start, start + 3 * k)  # fmt: skip
            )
            refused = async_rollout_error(True, S, HFRollout(), sync_every=k) is not None
            assert reachable == (k <= S + 1) == (not refused), (S, k)


def test_a_decoder_without_the_sampler_s_log_probs_is_refused_where_groups_can_be_stale():
    """transformers' ``generate`` returns no log-probs: with S >= 1 the first stale group raised in the update, at a
    step that depends on timing; the config check refuses it, naming the field. At S = 0 no group is stale."""
    error = async_rollout_error(True, 1, HFRollout(decoder="generate"))
    assert error is not None and "model.rollout.decoder='generate'" in error and "model.max_staleness=0" in error
    assert async_rollout_error(True, 0, HFRollout(decoder="generate")) is None
    assert async_rollout_error(True, 1, HFRollout()) is None


def test_rollout_versions_travel_with_their_rows():
    n, g = 6, 2
    batch = RolloutBatch(torch.zeros(n, 5, dtype=torch.long), torch.ones(n, 5, dtype=torch.long),
                         torch.ones(n, 3, dtype=torch.bool), ["x"] * n, torch.zeros(n, dtype=torch.bool), g,
                         versions=torch.tensor([4, 4, 5, 5, 6, 6]))  # fmt: skip
    assert batch.select_groups(torch.tensor([2, 0])).versions.tolist() == [6, 6, 4, 4]
    assert RolloutBatch.cat([batch, batch]).versions.tolist() == [4, 4, 5, 5, 6, 6] * 2
    assert RolloutBatch.cat([batch, dataclasses.replace(batch, versions=None)]).versions is None
    with pytest.raises(ValueError, match="versions must be"):
        dataclasses.replace(batch, versions=torch.zeros(n - 1, dtype=torch.long))


def _echo(text: str) -> str:
    """A tool (the async refusal test's environment)."""
    return text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"async_rollout": True, "max_staleness": 1, "sync_every": 3}, "model.sync_every"),
        ({"async_rollout": True, "max_staleness": 0, "sync_every": 2}, "model.sync_every"),
        ({"async_rollout": False, "sync_every": 2}, "model.sync_every"),
        ({"async_rollout": True, "sync_every": 0}, "model.sync_every"),
        ({"async_rollout": True, "max_staleness": -1}, "model.max_staleness"),
        ({"async_rollout": False, "max_staleness": 1.5}, "model.max_staleness"),
        ({"async_rollout": True, "producer_timeout": 0.0}, "model.producer_timeout"),
        ({"async_rollout": True, "rollout": "fixed"}, "model.rollout"),
        ({"async_rollout": True, "environment": "tools"}, "model.environment"),
    ],
)
def test_async_settings_that_cannot_run_are_refused_in_one_line_before_any_model_loads(kwargs, field):
    if kwargs.get("rollout") == "fixed":
        kwargs = kwargs | {"rollout": FixedRollout(None, [], 4)}  # not an engine a producer can run
    if kwargs.get("environment") == "tools":
        from tasks.environment import ToolEnvironment

        kwargs = kwargs | {"environment": ToolEnvironment(tools=[_echo])}  # the producer samples single-turn only
    with pytest.raises(ValueError) as error:  # require's error: the CLI prints it as one line before any load
        GRPOPolicy("no/such/model", SyntheticTask(kind="sort", levels=[3]), SoftmaxGRPO(0.5), **kwargs)
    assert field in str(error.value) and "\n" not in str(error.value)


def test_async_settings_without_async_rollout_warn_that_the_run_is_synchronous(recwarn):
    """``--model.max_staleness=4`` without ``--model.async_rollout=true`` trained synchronously without a word."""
    task, estimator = SyntheticTask(kind="sort", levels=[3]), SoftmaxGRPO(0.5)
    with pytest.warns(UserWarning, match=r"model.max_staleness=4 and model.producer_timeout=30.0 take effect with "
                                         r"model.async_rollout=true only: this run samples synchronously"):
        GRPOPolicy("no/such/model", task, estimator, max_staleness=4, producer_timeout=30.0)
    recwarn.clear()
    GRPOPolicy("no/such/model", task, estimator)  # defaults: nothing to say
    GRPOPolicy("no/such/model", task, estimator, async_rollout=True, max_staleness=4)
    assert not [w for w in recwarn if "async_rollout" in str(w.message)]


# ----------------------------------------------------------------------------------------------- fits
@pytest.mark.slow
def test_staleness_0_through_the_producer_is_the_synchronous_run_for_each_estimator(tmp_path):
    """Every logged value but timings, and the final weights, bit for bit (fp32, 1 process), per estimator; at
    staleness 1 the weights differ (the comparison can fail)."""
    for estimator in ("GRPO", "SoftmaxGRPO", "MaxRL", "DrGRPO"):
        option = f"--model.estimator=estimators.{estimator}"
        sync = fit(tmp_path / f"sync_{estimator}", option)
        stale0 = fit(tmp_path / f"async0_{estimator}", option, *asynchronous(0))
        assert untimed(stale0) == untimed(sync), estimator
        assert len(untimed(sync)) > 20 and len(sync["train/loss"]) == 3
        assert [v for _, v in stale0["train/async/staleness_max"]] == [0.0, 0.0, 0.0]
        assert same_weights(tmp_path / f"sync_{estimator}", tmp_path / f"async0_{estimator}"), estimator
    stale1 = fit(tmp_path / "async1", *asynchronous(1))
    assert [v for _, v in stale1["train/async/staleness_max"]] == [0.0, 1.0, 1.0]
    assert not same_weights(tmp_path / "sync_SoftmaxGRPO", tmp_path / "async1")


@pytest.mark.slow
def test_with_sync_every_the_producer_samples_only_pushed_versions_within_the_bound(tmp_path):
    """S = 2, weights pushed every 3 steps: the producer holds version 0 until the trainer pushes version 3, so
    steps 0, 1, 2 are sampled under version 0 and step 3 under version 3 (staleness 0, 1, 2, 0), however fast
    either side runs: no step is sampled under a version that was never pushed, none passes S, every step trains
    its 4 whole groups. With a push after every step (sync_every 1) the lags would depend on the two sides'
    speeds (step 2 sampled under version 0, 1 or 2); here every one is fixed by the pushes."""
    metrics = fit(tmp_path / "k3", *asynchronous(2), "--model.sync_every=3", steps=4)
    lags = check_bounded(metrics, 2, 4, 4)
    assert lags == [0.0, 1.0, 2.0, 0.0] and [v for _, v in metrics["train/async/staleness_mean"]] == lags
    shares = [[v for _, v in metrics[f"train/async/staleness_hist/{k}"]] for k in range(3)]
    assert [list(step) for step in zip(*shares)] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def check_bounded(metrics: dict, staleness: int, steps: int, groups: int, dynamic: bool = False) -> list[float]:
    """Every step trained ``groups`` whole groups (``dynamic``: at most that many, the step's informative ones),
    none older than ``staleness``; the staleness per step."""
    lags = [v for _, v in metrics["train/async/staleness_max"]]
    assert len(lags) == steps and max(lags) <= staleness
    trained = [v for _, v in metrics["train/async/groups"]]
    if dynamic:  # as many as the step's informative groups, up to its share (the rest of the last round unused)
        kept = [v for _, v in metrics["train/async/groups_sampled"]]
        dropped = [v for _, v in metrics["train/sampling/groups_dropped"]]
        assert all(t == min(groups, k - d) for t, k, d in zip(trained, kept, dropped, strict=True))  # none: 0
    else:
        assert trained == [float(groups)] * steps  # groups in = groups out
    for step in range(steps):
        shares = [dict(metrics[f"train/async/staleness_hist/{k}"])[step] for k in range(staleness + 1)]
        assert sum(shares) == 1.0  # every group at a staleness in 0..S
    return lags


@pytest.mark.bench  # 22 s; make test keeps its 2-process twin (tests/test_sharded.py's joined launch)
def test_a_producer_5x_slower_or_5x_faster_than_the_trainer_stays_within_the_bound(tmp_path, monkeypatch):
    """S = 2. A slow producer (0.5 s a step; the tiny model trains a step in ~0.1 s): the trainer waits and groups
    come fresh. A fast one (the trainer made 0.4 s a step): the producer runs ahead until admission stops it,
    and the groups reach, never pass, staleness 2."""
    monkeypatch.setenv(DELAY_ENV, "0.5")
    slow = check_bounded(fit(tmp_path / "slow", *asynchronous(2), steps=5), 2, 5, 4)
    assert slow[0] == 0.0
    monkeypatch.delenv(DELAY_ENV)
    update = PolicyUpdate.update

    def slow_update(self, *args, **kwargs):
        time.sleep(0.4)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "update", slow_update)
    fast = check_bounded(fit(tmp_path / "fast", *asynchronous(2), steps=5), 2, 5, 4)
    assert fast[0] == 0.0 and fast[-1] == 2.0  # ahead as far as admission allows


@pytest.mark.slow
def test_dynamic_sampling_refills_come_from_the_producer_and_at_staleness_0_equal_the_synchronous_run(tmp_path):
    """Dynamic sampling through the producer: the zero-variance groups a step drops release their slots and the
    refill rounds are sampled by the producer with the synchronous path's refill prompts and seeds. At S = 0 every
    logged value but timings (rounds and groups dropped included) and the final weights are the synchronous
    run's, bit for bit; at S = 1 every trained group is within the bound and whole, and the groups counted
    (drawn = 4 a round) are what the rounds drew. The synchronous run refills at least once (else this proves
    nothing about refills)."""
    dynamic = ["--model.dynamic_sampling=true", "--model.max_sampling_rounds=3"]
    sync = fit(tmp_path / "sync", *dynamic, steps=3)
    rounds = [v for _, v in sync["train/sampling/rounds"]]
    assert max(rounds) > 1, rounds
    stale0 = fit(tmp_path / "async0", *dynamic, *asynchronous(0), steps=3)
    assert untimed(stale0) == untimed(sync)
    assert same_weights(tmp_path / "sync", tmp_path / "async0")
    for run, staleness in ((stale0, 0), (fit(tmp_path / "async1", *dynamic, *asynchronous(1), steps=3), 1)):
        rounds = [v for _, v in run["train/sampling/rounds"]]
        drawn = [v for _, v in run["train/async/groups_sampled"]]
        assert drawn == [4.0 * r for r in rounds], (staleness, rounds, drawn)  # every round's groups, counted
        assert check_bounded(run, staleness, 3, 4, dynamic=True) is not None


class Recording(GRPOPolicy):
    """Keeps each trained rollout with the step that trained it, and the weights of every version; with
    ``producer_dtype`` "float64" the producer holds its copy of the (float32) weights in float64, and the trainer
    gets its log-probs rounded to float32, as a float32 producer would store them."""

    producer_dtype = "float32"

    def start_producer(self, *args) -> None:
        self.versions = {self.rollout_step: copy.deepcopy(self.model.state_dict())}
        self.trained = []
        trainer_dtype, self.model_dtype = self.model_dtype, self.producer_dtype  # read into the producer's spec
        try:
            super().start_producer(*args)
        finally:
            self.model_dtype = trainer_dtype

    def take_rollout(self, examples, sampling_round=0):
        rollout = super().take_rollout(examples, sampling_round)
        self.trained.append((self.rollout_step, rollout))
        return dataclasses.replace(rollout, logprobs=rollout.logprobs.float())

    def push_weights(self) -> None:
        self.versions[self.rollout_step] = copy.deepcopy(self.model.state_dict())
        super().push_weights()


@pytest.mark.slow
@pytest.mark.parametrize("producer_dtype, bound", [("float64", 1e-12), ("float32", 5e-6)])
def test_behaviour_logprobs_of_a_stale_group_are_its_versions_float64_logprobs(producer_dtype, bound, monkeypatch):
    """Sampled at v, trained at v + k (k up to 2): the recorded log-probs equal a float64 forward at version v's
    weights, while those at the trainer's weights of v + k differ by more than 1e-4 (measured ~1), so a producer that
    recorded another version's log-probs fails. A float64 producer (its copy of the trainer's float32 weights held
    in float64, float64 logits) is within 1e-12, far inside the issue's 1e-6 (measured 1.3e-15, and the same
    against HF's own float64 logits); the float32 producer users run records float32's rounding of the KV-cached
    sampler: 5e-6, relative where |log p| > 1 (measured up to 2.0e-6, above the issue's 1e-6)."""
    update = PolicyUpdate.update
    monkeypatch.setattr(PolicyUpdate, "update", lambda self, *a, **k: (time.sleep(0.3), update(self, *a, **k))[1])
    task = SyntheticTask(kind="sort", levels=[3, 5], num_train=64, num_validation=4)
    policy = Recording(SHIPPED, task, SoftmaxGRPO(temperature=0.5), HFRollout(max_new_tokens=8), group_size=4,
                       prompts_per_step=4, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), async_rollout=True,
                       max_staleness=2)  # fmt: skip
    policy.producer_dtype = producer_dtype
    run_steps(policy, steps=5)
    reference = copy.deepcopy(policy.model).double()
    lags = set()
    for step, rollout in policy.trained:
        version = int(rollout.versions[0])
        lags.add(step - version)
        errors = []
        for weights_of in (version, step):
            reference.load_state_dict({k: v.double() for k, v in policy.versions[weights_of].items()})
            with torch.no_grad():
                logp, _ = completion_logprobs(reference, rollout.input_ids, rollout.attention_mask,
                                              rollout.completion_mask, 1.0)  # fmt: skip
            assert logp.dtype == torch.float64 and rollout.logprobs.dtype == getattr(torch, producer_dtype)
            gap = (logp - rollout.logprobs.double()).abs() / logp.abs().clamp_min(1.0)
            errors.append(float(gap[rollout.completion_mask].max()))  # float32's rounding of |log p| > 1 is relative
        assert errors[0] <= bound, (step, version, errors)
        if step != version:
            assert errors[1] > 1e-4  # the weights the trainer holds are not the ones that sampled
    assert lags >= {0, 2} and max(lags) <= 2


# ----------------------------------------------------------------------------------------------- faults
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die@1", "hang@1"])
def test_a_producer_that_dies_or_hangs_ends_the_fit_with_an_error_naming_it(fault, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, fault)
    started = time.monotonic()
    with pytest.raises(ProducerError) as error:
        fit(tmp_path / "run", *asynchronous(1), "--model.producer_timeout=4", steps=4)
    message = str(error.value)
    assert message.startswith("the rollout producer (process ")
    assert ("exit code -9" in message) if fault.startswith("die") else ("sent no groups for 4 s" in message), message
    assert time.monotonic() - started < 60


@pytest.mark.bench  # 30 s: with the kill -9 resume below and the kill trials, in `make test-bench`
def test_a_resume_with_groups_in_flight_trains_every_prompt_once_and_at_staleness_0_is_the_uninterrupted_run(
    tmp_path,
):
    """Stopped after step 3 with groups of later steps sampled (S = 2) or not (S = 0), resumed to step 6: the
    producer restarts at the checkpoint's step and weights, so no step's prompts are trained twice or skipped
    (each step's prompts are checked against the data stream), staleness restarts at 0, and at S = 0 every value
    and the final weights are the uninterrupted synchronous run's."""
    reference = fit(tmp_path / "sync", steps=6)
    for staleness in (0, 2):
        root = tmp_path / f"s{staleness}"
        fit(root, *asynchronous(staleness), "--checkpoint_every=1", steps=3)
        resumed = fit(root, *asynchronous(staleness), "--ckpt_path=last", steps=6)
        lags = check_bounded(resumed, staleness, 6, 4)
        assert lags[3] == 0.0  # the producer restarted at the resumed step's weights
        if staleness == 0:
            assert untimed(resumed) == untimed(reference)
            assert same_weights(root, tmp_path / "sync")


@pytest.mark.bench  # 48 s (a fresh interpreter and fork server): with the kill trials, in `make test-bench`
def test_kill_9_mid_run_resumes_to_the_uninterrupted_run(tmp_path):
    """An async fit (S = 0) killed with SIGKILL once it has a checkpoint, resumed to step 8: the rewards and final
    weights of the synchronous run; the orphaned producer and its fork server end on their own (before the producer
    cancelled its queue's flush at exit it hung there for good, and its fork server with it)."""
    reference = fit(tmp_path / "sync", steps=8)
    root = tmp_path / "run"
    command = [sys.executable, "-m", "sgrpo.fit", "--config", TINY, f"--trainer.default_root_dir={root}",
               "--trainer.max_steps=1000", "--trainer.val_check_interval=1000", "--checkpoint_every=1",
               "--trainer.enable_progress_bar=false", *asynchronous(0)]  # fmt: skip
    slow = {"OMP_NUM_THREADS": "1", DELAY_ENV: "0.3"}  # steps of 0.3 s or more: killed well before step 8
    process = subprocess.Popen(command, cwd=REPO, env=os.environ | slow, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 180
    while not (root / "checkpoints" / "last.ckpt").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(live_processes(process.pid)) >= 3  # the trainer, its fork server and its producer
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    left = time.monotonic() + 30  # the fork server's interpreter shutdown took up to 9 s at load average 20
    while live_processes(process.pid) and time.monotonic() < left:
        time.sleep(0.1)
    assert live_processes(process.pid) == []  # the producer saw its trainer gone, and the fork server followed
    resumed = fit(root, *asynchronous(0), "--ckpt_path=last", steps=8)
    got, want = dict(resumed["train/reward"]), dict(reference["train/reward"])
    assert len(set(range(8)) - set(got)) <= 1  # a kill between a checkpoint and its step's metrics loses those
    assert all(math.isclose(got[s], want[s], abs_tol=0) for s in set(got) & set(range(8)))
    assert same_weights(root, tmp_path / "sync")


@pytest.mark.slow
def test_a_refill_at_staleness_1_is_allowed_the_draw_in_progress_before_its_own(tmp_path, monkeypatch):
    """Dynamic sampling at S = 1: a refill waits for the producer to finish the later step it is drawing, then draws
    itself. A healthy producer (2 s a draw, timeout 3 s) was taken for a hung one at the first refill."""
    monkeypatch.setenv(DELAY_ENV, "2.0")
    metrics = fit(tmp_path, *asynchronous(1), "--model.dynamic_sampling=true", "--model.max_sampling_rounds=3",
                  "--model.producer_timeout=3", steps=2)  # fmt: skip
    assert sorted(step for step, _ in metrics["train/reward"]) == [0, 1]
