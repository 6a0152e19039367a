"""``AsyncRollouts``, mixed into ``GRPOPolicy``: with ``async_rollout``, one step's groups come from a producer
process (``sgrpo.rollout.producer``) that samples ahead of the trainer, at most ``max_staleness`` versions
behind it, instead of from ``self.rollout`` inside the step. Off, nothing here runs."""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
from torch import Tensor

from sgrpo.model.lora import plain_weights
from sgrpo.rollout.hf import HFRollout
from sgrpo.rollout.producer import ProducerSpec, RolloutProducer
from sgrpo.run.data import mix_seed
from sgrpo.types import Example, RolloutBatch


def async_rollout_error(
    async_rollout: bool, max_staleness: int, rollout, dynamic_sampling: bool, environment=None
) -> str | None:
    """Why the async settings cannot run, in one line naming the field, or None."""
    if not isinstance(max_staleness, int) or max_staleness < 0:
        return f"model.max_staleness must be an integer >= 0 (versions a trained group may lag), got {max_staleness!r}"
    if not async_rollout:
        return None
    if not isinstance(rollout, HFRollout):
        return (f"model.async_rollout=true needs model.rollout to be sgrpo.rollout.HFRollout (it samples in a "
                f"producer process holding its own weights), got {type(rollout).__name__}; set "
                f"model.async_rollout=false")  # fmt: skip
    if dynamic_sampling:
        return ("model.async_rollout=true does not run with model.dynamic_sampling=true (its refill rounds would be "
                "sampled inside the step): turn one of them off")  # fmt: skip
    if environment is not None:
        return ("model.async_rollout=true does not run with model.environment yet (the producer samples single-turn "
                "completions): set model.async_rollout=false or model.environment=null")  # fmt: skip
    return None


def thread_split(threads: int, max_staleness: int, device: str) -> tuple[int, int]:
    """(trainer, producer) intra-op threads for an async run whose trainer has ``threads`` (``torch.get_num_threads``,
    i.e. ``OMP_NUM_THREADS``, what the synchronous run would use).

    At S = 0 the two never run at once (the producer samples a step after the push that ends the one before, the
    trainer waits for it), so both keep ``threads``: the synchronous run's sampling, bit for bit. At S >= 1 on the
    CPU they overlap, so they share the budget: the producer gets threads // 2 and the trainer the rest (each at
    least 1), instead of 2 x ``threads`` OpenMP threads contending for the cores one trainer was given (on a loaded
    2-core machine 2 threads instead of 1 already made the synchronous quickstart's steps take 14x the CPU seconds:
    spin waits). On a GPU both keep ``threads`` (the host threads only launch kernels)."""
    if max_staleness == 0 or not device.startswith("cpu"):
        return threads, threads
    producer = max(1, threads // 2)
    return max(1, threads - producer), producer


def sampling_seed(seed: int, rank: int, step: int) -> int:
    """The seed of step ``step``'s rollout on process ``rank``: ``GroupCollection.sample``'s (a round-0 draw)."""
    return mix_seed(seed, step, rank)


class AsyncRollouts:
    """The producer's lifetime (``start_producer``, ``stop_producer``) and its use in a step (``take_rollout``,
    ``push_weights``, ``async_logs``)."""

    _producer: RolloutProducer | None = None

    def start_producer(self, stream, first_step: int, last_step: int) -> None:
        """Spawn the producer for steps ``first_step`` .. ``last_step - 1`` of ``stream`` (``.batch(step)``), at the
        current weights (version ``first_step``)."""
        self.stop_producer()
        self._threads = torch.get_num_threads()  # restored when the producer stops
        trainer_threads, producer_threads = thread_split(self._threads, self.max_staleness, str(self.device))
        spec = ProducerSpec(
            model_path=self.model_path,
            dtype=self.model_dtype,
            tokenizer=self.tokenizer,
            engine=self.rollout,
            prompts=stream.batch,
            seed_of=functools.partial(sampling_seed, self.seed, self.global_rank),
            group_size=self.group_size,
            max_staleness=self.max_staleness,
            start_step=first_step,
            end_step=last_step,
            threads=producer_threads,
            device=str(self.device),
        )
        self._producer = RolloutProducer(spec, self._plain_weights(), self.producer_timeout)
        torch.set_num_threads(trainer_threads)  # once the producer runs (stop_producer gives them back)
        self._async = {"wait_s": 0.0, "weight_sync_s": 0.0}

    def stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
            torch.set_num_threads(self._threads)

    def _plain_weights(self):
        return plain_weights(self.model, buffers=False)  # adapters merged, FSDP2 shards gathered (collectives)

    def take_rollout(self, examples: list[Example]) -> RolloutBatch:
        """This step's groups from the producer (waiting for them: ``train/async/trainer_wait_s``)."""
        started = time.perf_counter()
        block = self._producer.take(self.rollout_step, [ex.prompt for ex in examples])
        self._async |= {"wait_s": time.perf_counter() - started, "idle_s": block.idle_s, "sample_s": block.sample_s}
        rollout = block.rollout  # tensors come to this process on the CPU; the update's are on its device
        moved = {f.name: getattr(rollout, f.name).to(self.device) for f in dataclasses.fields(rollout)
                 if isinstance(getattr(rollout, f.name), Tensor)}  # fmt: skip
        return dataclasses.replace(rollout, **moved)

    def push_weights(self) -> None:
        """After a training step: the weights, version ``rollout_step``, to the producer."""
        if self._producer is not None:
            self._async["weight_sync_s"] = self._producer.push(self._plain_weights(), self.rollout_step)

    def async_logs(self, rollout: RolloutBatch, trained_at: int) -> dict[str, Tensor | float]:
        """``train/async/*``: staleness of the step's groups (mean, and per value 0..S their share: the histogram),
        producer idle and sampling seconds, trainer wait seconds, weight-sync seconds."""
        staleness = (trained_at - rollout.versions.view(-1, rollout.group_size)[:, 0]).float()  # [B] per group
        logs: dict[str, Tensor | float] = {"train/async/staleness_mean": staleness.mean()}
        for k in range(self.max_staleness + 1):
            logs[f"train/async/staleness_hist/{k}"] = (staleness == k).float().mean()
        logs |= {
            "train/async/producer_idle_s": self._async.get("idle_s", 0.0),
            "train/async/producer_sample_s": self._async.get("sample_s", 0.0),
            "train/async/trainer_wait_s": self._async["wait_s"],
            "train/async/weight_sync_s": self._async["weight_sync_s"],
        }
        return logs
