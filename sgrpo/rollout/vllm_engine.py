"""vLLM rollout engine: one colocated vLLM engine per training process, given the policy's weights before each rollout.

Each process owns a vLLM ``LLM`` on its own GPU (``distributed_executor_backend="external_launcher"``,
the per-rank colocate layout of TRL and verl), generates the completions of its own prompts, and is
refreshed from the policy's parameters at the start of every ``generate`` call (full or FSDP2-sharded
parameters, gathered one tensor at a time). vLLM is a GPU extra (``pip install -e '.[vllm]'``): it is
imported on first use only, so configs naming this engine parse and instantiate on any machine.

The pure pieces (request building, output conversion) are ``sgrpo.rollout.vllm_requests``; the engine
calls them, and ``sgrpo.rollout.weightsync`` turns the policy's weights into what the engine loads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import socket
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from sgrpo.distributed import close_before_release
from sgrpo.rollout.engine import RolloutEngine, stop_and_pad_ids, weights_version
from sgrpo.rollout.vllm_requests import fitting_prompt_ids, rollout_batch_from_outputs, sampling_kwargs
from sgrpo.rollout.weightsync import (
    as_dtype,
    begin_reload,
    end_reload,
    engine_weights,
    load_chunk,
    unwrap,
    weight_chunks,
)
from sgrpo.types import Example, RolloutBatch

INSTALL_HINT = "pip install -e '.[vllm]'"
log = logging.getLogger(__name__)


def import_vllm():
    """The ``vllm`` module, or an ImportError that names the install command."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"VLLMRollout needs vLLM, a GPU extra that is not installed here ({err}). Install it with "
            f"`{INSTALL_HINT}` on a CUDA machine, or use sgrpo.rollout.HFRollout."
        ) from err
    return vllm


class VLLMRollout(RolloutEngine):
    """Rollouts from a colocated vLLM engine, one per training process (GPU extra).

    Each process builds ``vllm.LLM(model.name_or_path, distributed_executor_backend="external_launcher")``
    on its GPU at its first ``generate`` and keeps it. Every ``generate``:
      1. wakes the engine's weights (with ``sleep``), copies the policy's current parameters into
         them (``engine_weights``: HF names, FSDP2 shards gathered one tensor at a time, in chunks of
         ``weight_chunk_mib``, loaded by vLLM's layerwise reload), resets vLLM's prefix cache, then wakes the KV cache;
      2. samples G completions per prompt (``n = G``; per-request seeds drawn from torch's RNG,
         which GRPOPolicy seeds from (seed, step, rank), so a resumed run draws the same seeds);
      3. sleeps (level 1: weights to CPU, KV cache freed) so training gets the memory back.
    Syncing at the start of ``generate`` instead of after each optimiser step gives the same
    samples (the engine is only read there) without waking the engine during the update.

    Log-probs are vLLM's ``processed_logprobs`` (after temperature) of the sampled tokens; the loss
    corrects for vLLM's numerics (truncated importance sampling, ``sgrpo.train.ClippedSurrogate``).

    Sleep level 2 is not used: vLLM issue 29341 reports garbage outputs after a level-2 wake.

    Args:
        max_new_tokens: Completion length cap in tokens.
        temperature: Sampling temperature (> 0; the loss uses the same).
        top_p: Nucleus sampling (1: off); in training the loss's log-probs stay the full softmax's, as verl's.
        top_k: Top-k sampling (0: off; refused for training).
        gpu_memory_utilization: Share of the GPU vLLM may take while awake (weights and KV cache).
        sleep: Offload the engine between rollouts so the update gets the memory (without a sleep mode, on CPU: off).
        tensor_parallel_size: Processes per engine (consecutive ranks; they pool their prompts).
        max_model_len: Prompt + completion tokens per row (null: the model's).
        dtype: vLLM's weights dtype.
        seed: Engine seed.
        seed_per_request: Per-request seeds from torch's RNG (vLLM's V1 runner then samples each sequence with
            its own generator, a Python loop per decode step); off: the engine is seeded per step from torch's
            RNG (``engine_rng``). Either way a resumed run draws the same.
        enforce_eager: No CUDA graphs in vLLM.
        weight_chunk_mib: Size of a weight sync chunk.
        engine_kwargs: Passed to ``vllm.LLM`` as they are (``max_num_seqs``, ``enable_prefix_caching``, ...).
    """

    samples_from_policy = False  # its own copy of the weights and its own kernels

    def __init__(
        self,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        gpu_memory_utilization: float = 0.3,
        sleep: bool = True,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16",
        seed: int = 0,
        seed_per_request: bool = False,
        enforce_eager: bool = False,
        weight_chunk_mib: float = 512.0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        checks = [
            (max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
            (math.isfinite(temperature) and temperature > 0, f"temperature must be > 0, got {temperature}"),
            (0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
            (top_k >= 0, f"top_k must be >= 0 (0 disables it), got {top_k}"),
            (
                0 < gpu_memory_utilization <= 1,
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}",
            ),
            (tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}"),
            (max_model_len is None or max_model_len > max_new_tokens, "max_model_len must exceed max_new_tokens"),
            (weight_chunk_mib > 0, f"weight_chunk_mib must be > 0, got {weight_chunk_mib}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.gpu_memory_utilization, self.sleep = gpu_memory_utilization, sleep
        self.tensor_parallel_size, self.max_model_len, self.dtype = tensor_parallel_size, max_model_len, dtype
        self.seed, self.seed_per_request = seed, seed_per_request
        self.enforce_eager, self.weight_chunk_mib = enforce_eager, weight_chunk_mib
        self.engine_kwargs = dict(engine_kwargs or {})
        self._llm = None
        self._asleep = False
        self._tp_group = None
        self._names_checked = False
        self._synced: tuple[int, int] | None = None  # (model, weights version) the engine holds
        self._held = False

    @property
    def max_total_tokens(self) -> int | None:
        """Prompt + completion tokens the engine takes (``max_model_len``; None: the model's positions)."""
        return self.max_model_len

    def preflight(self) -> str | None:
        """Why this engine cannot run here (vLLM not installed), or None: checked before the model loads
        (``sgrpo.run.preflight``), where ``generate`` would fail only at the first rollout."""
        if importlib.util.find_spec("vllm") is None:
            return f"VLLMRollout needs vLLM, which is not installed here: `{INSTALL_HINT}` (or use HFRollout)"
        return None

    def generate(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, greedy: bool = False
    ) -> RolloutBatch:
        vllm = import_vllm()
        eos, pad = stop_and_pad_ids(model, tokenizer)
        prompts = fitting_prompt_ids(tokenizer, examples, self.max_model_len)
        draw = self.seed_per_request and not greedy
        seeds = torch.randint(2**31 - 1, (len(prompts),), device="cpu").tolist() if draw else [None] * len(prompts)
        step_seed = None if greedy or draw else int(torch.randint(2**31 - 1, (1,), device="cpu"))
        llm = self._engine(model)
        self._ready(llm, model)
        prompts, seeds, rows, step_seed = self._pool_group(prompts, seeds, step_seed)
        params = [
            vllm.SamplingParams(
                **sampling_kwargs(
                    group_size=group_size,
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    top_k=self.top_k,
                    stop_token_ids=eos,
                    greedy=greedy,
                    seed=seed,
                )
            )
            for seed in seeds
        ]
        with engine_rng(step_seed):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[rows]
        if self.sleep and not self._held:
            llm.sleep(level=1)
            self._asleep = True
        device = next(model.parameters()).device
        return rollout_batch_from_outputs(outputs, group_size, pad, tokenizer, device)

    @property
    def runs_episodes(self) -> bool:  # model.environment: sgrpo.rollout.vllm_episodes, one engine per process
        return self.tensor_parallel_size == 1

    def generate_episodes(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, environment,
        greedy: bool = False,
    ) -> RolloutBatch:  # fmt: skip
        """Multi-turn episodes (``sgrpo.rollout.vllm_episodes``): synced and woken once, asleep after the last turn."""
        from sgrpo.rollout.vllm_episodes import vllm_episodes

        args = (model, tokenizer, examples, group_size, environment, greedy)
        return vllm_episodes(self, import_vllm().SamplingParams, engine_rng, *args)

    def _ready(self, llm, model: nn.Module) -> None:
        """Wake the engine if it sleeps and copy the policy's weights into it if they changed since the last sync
        (``weights_version``: bumped by each optimiser step; unknown: always copied). The cache allocator's free
        blocks go back to the device before each wake-up (the trainer's, then the sync's gathered tensors)."""
        version = weights_version(unwrap(model))
        stale = version is None or self._synced != (id(unwrap(model)), version)
        if self._asleep:
            empty_device_cache()  # hand the trainer's cached blocks back before vLLM maps its memory
            llm.wake_up(tags=["weights"])
        if stale:
            self.sync_weights(model)
        if self._asleep:
            empty_device_cache()  # the sync's freed blocks, before the KV cache is mapped again
            llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def hold(self) -> None:
        """Stay awake between ``generate`` calls (a validation: its batches share the weights) until ``release``."""
        self._held = True

    def release(self) -> None:
        """Sleep now if ``hold`` kept the engine awake (with ``sleep``)."""
        self._held = False
        if self.sleep and self._llm is not None and not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    @torch.no_grad()
    def sync_weights(self, model: nn.Module) -> None:
        """Copy ``model``'s current parameters into the engine, chunk by chunk, then reset the prefix cache.

        The tensors are gathered here (FSDP2: every process must call this together), cast to the
        engine's dtype and loaded by vLLM's layerwise reload (``sgrpo.rollout.weightsync.begin_reload``: every
        kernel's copy refreshed, tied heads included). The first call checks that every engine
        parameter received a value.
        """
        llm = self._engine(model)
        config = llm.llm_engine.vllm_config
        dtype = config.model_config.dtype
        # gathered in the engine's dtype (bf16: half the bytes of float32), in buckets of one chunk: one collective each
        weights = as_dtype(engine_weights(model, dtype, bucket_bytes=int(self.weight_chunk_mib * 2**20)), dtype)
        llm.apply_model(lambda engine_model: begin_reload(engine_model, config))
        loaded: set[str] = set()
        for chunk in weight_chunks(weights, int(self.weight_chunk_mib * 2**20)):
            for names in llm.apply_model(lambda engine_model, chunk=chunk: load_chunk(engine_model, chunk, config)):
                loaded |= names
        llm.apply_model(lambda engine_model: end_reload(engine_model, config))
        if not self._names_checked and loaded:  # models whose load_weights reports nothing are not checked
            expected = llm.apply_model(lambda engine_model: [n for n, _ in engine_model.named_parameters()])[0]
            missing = sorted(set(expected) - loaded)
            if missing:
                raise RuntimeError(
                    f"{len(missing)} vLLM parameters got no value from the policy, e.g. {missing[:5]}: the "
                    "policy's parameter names do not map to this model's checkpoint names (see hf_parameter_name)"
                )
        self._names_checked = True
        llm.reset_prefix_cache()
        version = weights_version(unwrap(model))
        self._synced = None if version is None else (id(unwrap(model)), version)

    def _engine(self, model: nn.Module):
        if self._llm is not None:
            return self._llm
        vllm = import_vllm()
        path = getattr(unwrap(model), "name_or_path", "")
        if not path:
            raise ValueError("VLLMRollout loads the engine from the policy's folder or hub id (model.name_or_path)")
        env = launcher_env()
        os.environ.update(env)
        rank, world, tp = int(env["RANK"]), int(env["WORLD_SIZE"]), self.tensor_parallel_size
        if world % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the number of processes ({world})")
        if tp > 1:  # a collective: every process builds its engine at the same step
            groups = [list(range(start, start + tp)) for start in range(0, world, tp)]
            self._tp_group, _ = torch.distributed.new_subgroups_by_enumeration(groups)
        if self.sleep and not sleep_mode_available():
            log.warning("VLLMRollout: vLLM has no sleep mode on this platform: the engine keeps its memory between "
                        "rollouts (as with sleep: false)")  # fmt: skip
            self.sleep = False
        with kept_torch_threads():
            self._llm = vllm.LLM(
                model=path,
                dtype=self.dtype,
                tensor_parallel_size=tp,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_len,
                enable_sleep_mode=self.sleep,
                enforce_eager=self.enforce_eager,
                distributed_executor_backend="external_launcher",
                seed=self.seed + rank // tp,  # one seed per engine; the processes of a TP group must agree
                logprobs_mode="processed_logprobs",  # log-probs of the sampling distribution (after temperature)
                **self.engine_kwargs,
            )
        close_before_release(self.close)
        return self._llm

    def close(self) -> None:
        """Shut the engine down (it is built again on the next ``generate``); ``sgrpo.fit`` calls this at exit."""
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm, self._asleep, self._names_checked, self._synced = None, False, False, None

    def _pool_group(self, prompts: list[list[int]], seeds: list, step_seed: int | None):
        """With tensor parallelism, every process of a group feeds the group's prompts; ``rows`` are its own, and
        the group samples with its first process's ``step_seed``. Returns (prompts, seeds, rows, step_seed)."""
        if self._tp_group is None:
            return prompts, seeds, slice(0, len(prompts)), step_seed
        parts: list[Any] = [None] * self.tensor_parallel_size
        torch.distributed.all_gather_object(parts, (prompts, seeds, step_seed), group=self._tp_group)
        start = sum(len(p) for p, _, _ in parts[: torch.distributed.get_rank(self._tp_group)])
        pooled = [x for p, _, _ in parts for x in p], [x for _, s, _ in parts for x in s]
        return *pooled, slice(start, start + len(prompts)), parts[0][2]


def empty_device_cache() -> None:
    """``torch.cuda.empty_cache()`` where CUDA is in use (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def engine_rng(seed: int | None):
    """Seed torch's generators (the CPU's and every CUDA device's) and numpy's global one with ``seed`` while the
    block runs, then put their states back; nothing without a seed.

    The colocated engine samples in this process (external launcher). Requests without a seed of their own draw
    from the device's default generator under vLLM's V1 model runner (the CPU build's), and under the V2 runner
    (vLLM's default on CUDA) from a seed each request takes from numpy's global RNG
    (``vllm.v1.worker.gpu.sample.states``): both seeded per step (``seed`` drawn from torch's RNG, which
    ``GRPOPolicy`` seeds from (seed, step, rank)), a run and its resume draw the same, validations do not shift
    the training samples, and vLLM's sampler keeps its batched path (per-request seeds take a Python loop over
    the sequences at every decode step under V1).
    """
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            yield
    finally:
        np.random.set_state(numpy_state)


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep on this platform (not on CPU: ``enable_sleep_mode`` is refused there)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


@contextlib.contextmanager
def kept_torch_threads():
    """Keep torch's thread count and ``torch.set_num_threads`` as they were across an engine build.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that only logs a warning,
    process-wide, and may lower the thread count to 1 for serving; the colocated trainer shares the
    process, so both are put back.
    """
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = setter
        if torch.get_num_threads() != threads:
            setter(threads)


def launcher_env() -> dict[str, str]:
    """The variables vLLM's external launcher reads, from the running process group (or a lone process)."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    local = os.environ.get("LOCAL_RANK") or str(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": local,
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
