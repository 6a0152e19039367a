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
from sgrpo.rollout.server_producer import ServerProducer
from sgrpo.rollout.vllm_server import VLLMServerRollout
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
    if not isinstance(rollout, (HFRollout, VLLMServerRollout)):
        return (f"model.async_rollout=true needs model.rollout to be sgrpo.rollout.HFRollout (it samples in a "
                f"producer process holding its own weights) or sgrpo.rollout.VLLMServerRollout (the servers are the "
                f"producer), got {type(rollout).__name__}; set model.async_rollout=false")  # fmt: skip
    if dynamic_sampling:
        return ("model.async_rollout=true does not run with model.dynamic_sampling=true (its refill rounds would be "
                "sampled inside the step): turn one of them off")  # fmt: skip
    if environment is not None:
        return ("model.async_rollout=true does not run with model.environment yet (the producer samples single-turn "
                "completions): set model.async_rollout=false or model.environment=null")  # fmt: skip
    return None


def sampling_seed(seed: int, rank: int, step: int) -> int:
    """The seed of step ``step``'s rollout on process ``rank``: ``GroupCollection.sample``'s (a round-0 draw)."""
    return mix_seed(seed, step, rank)


class AsyncRollouts:
    """The producer's lifetime (``start_producer``, ``stop_producer``) and its use in a step (``take_rollout``,
    ``push_weights``, ``async_logs``)."""

    _producer: RolloutProducer | ServerProducer | None = None

    def start_producer(self, stream, first_step: int, last_step: int) -> None:
        """Spawn the producer for steps ``first_step`` .. ``last_step - 1`` of ``stream`` (``.batch(step)``), at the
        current weights (version ``first_step``)."""
        self.stop_producer()
        self._async = {"wait_s": 0.0, "weight_sync_s": 0.0}
        seed_of = functools.partial(sampling_seed, self.seed, self.global_rank)
        if isinstance(self.rollout, VLLMServerRollout):  # the servers sample; threads here keep requests in flight
            self._producer = ServerProducer(self.rollout, self.model, self.tokenizer, stream.batch, seed_of,
                                            self.group_size, self.max_staleness, first_step, last_step,
                                            self.producer_timeout)  # fmt: skip
            return
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
            threads=torch.get_num_threads(),
            device=str(self.device),
        )
        self._producer = RolloutProducer(spec, self._plain_weights(), self.producer_timeout)

    def stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None

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
        producer idle and sampling seconds, trainer wait seconds, weight-sync seconds; with vLLM servers that keep
        requests across pushes, the versions a group's sampling spanned (newest - oldest, mean)."""
        staleness = (trained_at - rollout.versions.view(-1, rollout.group_size)[:, 0]).float()  # [B] per group
        logs: dict[str, Tensor | float] = {"train/async/staleness_mean": staleness.mean()}
        for k in range(self.max_staleness + 1):
            logs[f"train/async/staleness_hist/{k}"] = (staleness == k).float().mean()
        if rollout.newest_versions is not None:  # vLLM servers with requests kept across pushes: versions spanned
            newest, oldest = (v.view(-1, rollout.group_size)[:, 0] for v in (rollout.newest_versions, rollout.versions))
            logs["train/async/version_span_mean"] = (newest - oldest).float().mean()
        logs |= {
            "train/async/producer_idle_s": self._async.get("idle_s", 0.0),
            "train/async/producer_sample_s": self._async.get("sample_s", 0.0),
            "train/async/trainer_wait_s": self._async["wait_s"],
            "train/async/weight_sync_s": self._async["weight_sync_s"],
        }
        return logs
