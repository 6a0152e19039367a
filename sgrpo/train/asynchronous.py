"""``AsyncRollouts``, mixed into ``GRPOPolicy``: with ``async_rollout``, one step's groups come from a producer
process (``sgrpo.rollout.producer``) that samples ahead of the trainer, at most ``max_staleness`` versions
behind it, instead of from ``self.rollout`` inside the step. Off, nothing here runs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
from lightning.pytorch import Callback
from torch import Tensor

from sgrpo.model.lora import plain_layout, plain_weights
from sgrpo.model.packing import attention_implementation
from sgrpo.rollout.hf import HFRollout
from sgrpo.rollout.producer import RolloutProducer
from sgrpo.rollout.producer_process import ProducerSpec
from sgrpo.rollout.server_producer import ServerProducer
from sgrpo.rollout.vllm_http import ServerError
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.run.data import mix_seed
from sgrpo.run.precision import sampling_precision
from sgrpo.run.signals import stop_recorded
from sgrpo.train.step_logging import global_means
from sgrpo.types import Example, RolloutBatch

log = logging.getLogger(__name__)


def async_rollout_error(
    async_rollout: bool,
    max_staleness: int,
    rollout,
    sync_every: int = 1,
    environment=None,
) -> str | None:
    """Why the async settings cannot run, in one line naming the field, or None."""
    if not isinstance(max_staleness, int) or max_staleness < 0:
        return f"model.max_staleness must be an integer >= 0 (versions a trained group may lag), got {max_staleness!r}"
    if not isinstance(sync_every, int) or sync_every < 1:
        return f"model.sync_every must be an integer >= 1 (training steps between weight pushes), got {sync_every!r}"
    if not async_rollout:
        return None if sync_every == 1 else "model.sync_every applies to model.async_rollout=true only: set it to 1"
    if sync_every > max_staleness + 1:  # the trainer at version t needs step t, sampled at most S versions back
        return (f"model.sync_every={sync_every} cannot keep model.max_staleness={max_staleness}: between pushes the "
                f"producer's weights lag up to sync_every - 1 versions, so set sync_every <= max_staleness + 1 "
                f"({max_staleness + 1}) or raise max_staleness to {sync_every - 1}")  # fmt: skip
    if not isinstance(rollout, (HFRollout, VLLMServerRollout)):
        return (f"model.async_rollout=true needs model.rollout to be sgrpo.rollout.HFRollout (it samples in a "
                f"producer process holding its own weights) or sgrpo.rollout.VLLMServerRollout (the servers are the "
                f"producer), got {type(rollout).__name__}; set model.async_rollout=false")  # fmt: skip
    if isinstance(rollout, HFRollout) and rollout.decoder != "lean" and max_staleness > 0:
        return (f"model.async_rollout=true with model.max_staleness={max_staleness} needs the sampler's log-probs "
                f"(a stale group's importance weights), which model.rollout.decoder={rollout.decoder!r} does not "
                f"return: set model.rollout.decoder=lean or model.max_staleness=0")  # fmt: skip
    if environment is not None:
        return ("model.async_rollout=true does not run with model.environment yet (the producer samples single-turn "
                "completions): set model.async_rollout=false or model.environment=null")  # fmt: skip
    return None


def unused_async_settings(async_rollout: bool, max_staleness: int, producer_timeout: float) -> str | None:
    """A warning when ``max_staleness`` or ``producer_timeout`` differ from their defaults but ``async_rollout`` is
    off: the run is synchronous, whatever they say (a user comparing with async keeps its config), or None."""
    if async_rollout:
        return None
    changed = [f"model.{name}={value}" for name, value, default in
               (("max_staleness", max_staleness, 1), ("producer_timeout", producer_timeout, 600.0)) if value != default]
    if not changed:
        return None
    return (f"{' and '.join(changed)} take effect with model.async_rollout=true only: this run samples "
            "synchronously (staleness 0)")  # fmt: skip


def thread_split(threads: int, max_staleness: int, device: str) -> tuple[int, int]:
    """(trainer, producer) intra-op threads for an async run whose trainer has ``threads`` (``torch.get_num_threads``,
    i.e. ``OMP_NUM_THREADS``, what the synchronous run would use).

    At S = 0 the producer samples a step after the push that ends the one before, and the trainer waits for it, so
    both keep ``threads``: the synchronous run's sampling, bit for bit (they overlap only while the trainer validates
    or saves a checkpoint after that push: oversubscribed, not changed). At S >= 1 on the
    CPU they overlap, so they share the budget: the producer gets threads // 2 and the trainer the rest (each at
    least 1), instead of 2 x ``threads`` OpenMP threads contending for the cores one trainer was given (on a loaded
    2-core machine 2 threads instead of 1 already made the synchronous quickstart's steps take 14x the CPU seconds:
    spin waits). On a GPU both keep ``threads`` (the host threads only launch kernels)."""
    if max_staleness == 0 or not device.startswith("cpu"):
        return threads, threads
    producer = max(1, threads // 2)
    return max(1, threads - producer), producer


def sampling_seed(seed: int, rank: int, step: int, sampling_round: int = 0) -> int:
    """The seed of step ``step``'s rollout (dynamic sampling's round ``sampling_round``) on process ``rank``:
    ``GroupCollection.sample``'s."""
    return mix_seed(seed, step, rank, *([sampling_round] if sampling_round else []))


#: bytes of full tensors gathered per collective in a push to the producer (FSDP2): fewer collectives than one per
#: parameter, and one bucket on the device at a time (the producer copies each as it comes)
PUSH_BUCKET_BYTES = 256 * 2**20


class StopProducerOnError(Callback):
    """Stops the policy's rollout producer when the fit raises: its process and block files would otherwise outlive
    the fit in this interpreter (a notebook, a second fit)."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        pl_module.stop_producer()


class AsyncRollouts:
    """The producer's lifetime (``start_producer``, ``stop_producer``) and its use in a step (``take_rollout``,
    ``push_weights``, ``async_logs``)."""

    _producer: RolloutProducer | ServerProducer | None = None

    def start_producer(self, stream, first_step: int, last_step: int) -> None:
        """Spawn the producer for steps ``first_step`` .. ``last_step - 1`` of ``stream`` (``.batch(step)``), at the
        current weights (version ``first_step``)."""
        self.stop_producer()
        self._async = {"wait_s": 0.0, "weight_sync_s": 0.0, "groups_sampled": 0}
        self._threads = torch.get_num_threads()  # restored when the producer stops
        seed_of = functools.partial(sampling_seed, self.seed, self.global_rank)
        refills = None if self._refill is None else self._refill.batch  # (step, round): collect's refill prompts
        if isinstance(self.rollout, VLLMServerRollout):  # the servers sample; threads here keep requests in flight
            self._producer = ServerProducer(self.rollout, self.model, self.tokenizer, stream.batch, seed_of,
                                            self.group_size, self.max_staleness, first_step, last_step,
                                            self.producer_timeout, refills, lambda: self.rollout_step)  # fmt: skip
            return
        trainer_threads, producer_threads = thread_split(self._threads, self.max_staleness, str(self.device))
        convert, autocast = sampling_precision(str(self.trainer.precision))
        gather = getattr(getattr(self, "model", None), "sgrpo_gather_dtype", None)  # FSDP2 mixed precision's blocks
        spec = ProducerSpec(
            model_path=self.model_path,
            dtype=self.model_dtype,
            tokenizer=self.tokenizer,
            engine=self.rollout,
            prompts=stream.batch,
            seed_of=seed_of,
            group_size=self.group_size,
            max_staleness=self.max_staleness,
            start_step=first_step,
            end_step=last_step,
            threads=producer_threads,
            device=str(self.device),
            convert=convert,
            autocast=autocast,
            gather_dtype=None if gather is None else str(gather).removeprefix("torch."),
            attention=attention_implementation(self.model),
            deterministic=(torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled()),  # fmt: skip
            refill_prompts=refills,
        )
        self._producer = RolloutProducer(spec, self._plain_weights(), self.producer_timeout, plain_layout(self.model))
        torch.set_num_threads(trainer_threads)  # once the producer runs (stop_producer gives them back)

    def configure_callbacks(self):
        """With ``async_rollout``: the producer stopped when the fit raises (Lightning runs no ``teardown`` then)."""
        return [StopProducerOnError()] if self.async_rollout else []

    def stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
            torch.set_num_threads(self._threads)

    def _plain_weights(self):
        """Adapters merged, FSDP2 shards gathered (collectives), ``PUSH_BUCKET_BYTES`` per collective."""
        return plain_weights(self.model, buffers=False, bucket_bytes=PUSH_BUCKET_BYTES)

    def take_rollout(self, examples: list[Example], sampling_round: int = 0) -> RolloutBatch:
        """This step's groups from the producer (waiting for them: ``train/async/trainer_wait_s``); with dynamic
        sampling, round ``sampling_round``'s refill, asked for now."""
        started, prompts = time.perf_counter(), [ex.prompt for ex in examples]
        if sampling_round:
            block = self._producer.refill(self.rollout_step, sampling_round, prompts)
        else:
            block = self._producer.take(self.rollout_step, prompts)
            self._async |= {"wait_s": 0.0, "idle_s": 0.0, "sample_s": 0.0, "groups_sampled": 0}
        self._async["wait_s"] += time.perf_counter() - started
        self._async["idle_s"] += block.idle_s
        self._async["sample_s"] += block.sample_s
        self._async["groups_sampled"] += block.rollout.num_groups
        rollout = block.rollout  # tensors come to this process on the CPU; the update's are on its device
        moved = {f.name: getattr(rollout, f.name).to(self.device) for f in dataclasses.fields(rollout)
                 if isinstance(getattr(rollout, f.name), Tensor)}  # fmt: skip
        return dataclasses.replace(rollout, **moved)

    def push_weights(self) -> None:
        """After a training step: the weights, version ``rollout_step``, to the producer (every ``sync_every``
        steps; between pushes the producer keeps sampling under the last ones, and admission waits for newer)."""
        if self._producer is not None and self.rollout_step % self.sync_every == 0:
            try:
                self._async["weight_sync_s"] = self._producer.push(
                    self._plain_weights(), self.rollout_step, attention_implementation(self.model)
                )
            except ServerError as err:  # SLURM's SIGTERM reaches the vLLM servers sgrpo launched too, and they go
                if not stop_recorded(self.trainer):
                    raise
                log.warning("the weights of step %d reached no vLLM server (%s) while the run stops: the step's end "
                            "is saved as it is, and the resumed run pushes them first", self.rollout_step, err)
                self._async["weight_sync_s"] = 0.0
        elif self._producer is not None:
            self._async["weight_sync_s"] = 0.0

    def async_logs(self, rollout: RolloutBatch, trained_at: int, trained: Tensor) -> dict[str, Tensor | float]:
        """``train/async/*``: staleness of the step's trained groups (``trained``, ``[B]`` bool: dynamic sampling's
        step whose every round was constant trains none; mean, max over processes, and per value 0..S their share:
        the histogram), groups trained and sampled (dynamic sampling's refills too; sums over processes), producer
        idle and sampling seconds, trainer wait seconds, weight-sync seconds; with vLLM servers that keep requests
        across pushes, the versions a group's sampling spanned (newest - oldest, mean)."""
        staleness = (trained_at - rollout.versions.view(-1, rollout.group_size)[:, 0]).float()[trained]  # per group
        top = staleness.max() if staleness.numel() else staleness.new_zeros(())  # none trained here: 0, the least
        self.log("train/async/staleness_max", top, sync_dist=True, reduce_fx="max")
        for key, groups in (("groups", staleness.numel()), ("groups_sampled", self._async["groups_sampled"])):
            count = torch.tensor(float(groups), dtype=torch.float32, device=self.device)  # not bf16 under bf16-true
            self.log(f"train/async/{key}", count, sync_dist=True, reduce_fx="sum")
        groups = staleness.numel()  # (sum, count) over every process's groups: processes may hold different numbers
        counted = {"train/async/staleness_mean": (staleness.sum(), groups)}
        for k in range(self.max_staleness + 1):
            counted[f"train/async/staleness_hist/{k}"] = ((staleness == k).float().sum(), groups)
        if rollout.newest_versions is not None:  # vLLM servers with requests kept across pushes: versions spanned
            newest, oldest = (v.view(-1, rollout.group_size)[:, 0] for v in (rollout.newest_versions, rollout.versions))
            counted["train/async/version_span_mean"] = ((newest - oldest)[trained].float().sum(), groups)
        self.log_dict(global_means(counted, lambda sums: self.trainer.strategy.reduce(sums, reduce_op="sum")))
        logs: dict[str, Tensor | float] = {
            "train/async/producer_idle_s": self._async.get("idle_s", 0.0),
            "train/async/producer_sample_s": self._async.get("sample_s", 0.0),
            "train/async/trainer_wait_s": self._async["wait_s"],
            "train/async/weight_sync_s": self._async["weight_sync_s"],
        }
        return logs
