"""The producer process of asynchronous rollouts (``sgrpo.rollout.producer``): what it loads, samples and sends
(``_produce``), and what it shares with the trainer's end (``ProducerSpec``, ``Block``, ``admitted``,
``ProducerError``). The design (admission, refills, faults) is in ``sgrpo.rollout.producer``'s docstring."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sgrpo.rollout.engine import RolloutEngine
from sgrpo.rollout.shared_weights import weight_views
from sgrpo.types import Example, RolloutBatch


class ProducerError(RuntimeError):
    """The rollout producer ended or hung: the trainer cannot get its next groups."""


def admitted(step: int, trainer_version: int, max_staleness: int) -> bool:
    """Whether step ``step``'s groups may be sampled with the trainer at ``trainer_version``.

    With g groups per step, steps 0 .. step - 1 accepted and step's g groups running, the rule
    accepted + running < (S + v + 1) g reads (step + 1) g <= (S + v + 1) g, i.e. step <= v + S.
    """
    return step <= trainer_version + max_staleness


@dataclass
class ProducerSpec:
    """What the producer process needs (pickled to it at spawn)."""

    model_path: str
    dtype: str
    tokenizer: Any
    engine: RolloutEngine
    prompts: Callable[[int], list[Example]]  # step -> this process's prompts of that step (the data stream)
    seed_of: Callable[..., int]  # (step[, round]) -> the synchronous path's sampling seed of it on this process
    group_size: int
    max_staleness: int
    start_step: int
    end_step: int  # steps start_step .. end_step - 1 are sampled
    threads: int
    device: str = "cpu"  # where the producer's copy samples (the trainer's device: colocated on one GPU)
    convert: str | None = None  # the dtype the loaded model is converted to, buffers too (trainer's bf16-true, ...)
    autocast: str | None = None  # the dtype it samples under autocast in (the trainer's bf16-mixed / 16-mixed)
    gather_dtype: str | None = None  # FSDP2 mixed precision's block dtype (model.sgrpo_gather_dtype), under autocast
    attention: str | None = None  # the trainer's model's attention implementation at the start (pushes may change it)
    deterministic: tuple[bool, bool] = (False, False)  # the trainer's use_deterministic_algorithms (on, warn_only)
    delay_s: float = 0.0  # test hook: seconds slept after each block
    fault: str = ""  # test hook: "die@STEP" or "hang@STEP"
    refill_prompts: Callable[[int, int], list[Example]] | None = None  # (step, round >= 1) -> dynamic sampling's


@dataclass
class Block:
    """One step's groups as the producer sends them."""

    step: int
    version: int
    prompts: list[Any]
    rollout: RolloutBatch
    idle_s: float  # seconds the producer waited (admission, a full queue) since its previous block
    sample_s: float
    sampling_round: int = 0  # dynamic sampling's refill round (0: the step's first draw)


def _pack(block: Block, folder: str) -> str:
    """Write ``block`` to a file of ``folder`` (whole, then renamed) and return its path: only the short path goes
    through the queue, in one atomic pipe write, so a producer killed mid-send leaves no partial message that
    would block the trainer's read for good."""
    path = os.path.join(folder, f"step{block.step}.{block.sampling_round}.pt")
    torch.save(block, path + ".part")
    os.replace(path + ".part", path)
    return path


def _alive(lifeline) -> bool:
    """Whether the trainer process lives: it never writes to the pipe, so a readable end means it closed (EOF)."""
    return not lifeline.poll()


def _produce(spec: ProducerSpec, shared, version, lock, pushed, queues, asked, stop, parent, folder: str,
             ready) -> None:  # fmt: skip
    """The producer process (``_sample_steps``). A trainer that ended without ``close`` (an error in another
    interpreter's fit, ``os._exit``, a kill) leaves the block folder to it: it deletes it as it ends.

    It ignores SIGINT and SIGTERM: a signal to the job's process group (Ctrl-C, a scheduler's preemption) reaches
    the producer too, and the trainer, which stops at the end of its step, still waits for that step's groups;
    the producer ends by ``stop`` or by its trainer's end, as always. The same signal ends the fork server, its
    parent, which the trainer then does not mistake for the producer's end (``sgrpo.rollout.producer.exit_code``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.use_deterministic_algorithms(spec.deterministic[0], warn_only=spec.deterministic[1])  # the trainer's flag
    try:
        _sample_steps(spec, shared, version, lock, pushed, queues, asked, stop, parent, folder, ready)
    finally:
        if not _alive(parent):
            shutil.rmtree(folder, ignore_errors=True)


def sampling_model(spec: ProducerSpec) -> torch.nn.Module:
    """The producer's model on ``spec.device``, loaded as the trainer's, each weight in the dtype the trainer's rollout
    samples with: converted as Lightning converts the trainer's (``convert``, buffers too) and, under FSDP2 mixed
    precision (``gather_dtype``), cast as the synchronous rollout's copy (``snapshot.RolloutWeights``) is: blocks in
    the gather dtype (norm weights too, which autocast alone leaves in float32), other ``nn.Linear`` but the LM head
    in autocast's, buffers as loaded. Pushed weights are rounded as they are copied in, as into that copy."""
    from sgrpo.model.loading import disable_dropout, load_causal_lm, resolve_model_path, to_dtype_keeping_frequencies
    from sgrpo.rollout.snapshot import cast_to_forward_dtypes

    model = load_causal_lm(resolve_model_path(spec.model_path), getattr(torch, spec.dtype), spec.device)  # as trainer's
    disable_dropout(model)
    if spec.convert:  # as Lightning converts the trainer's, RoPE's frequencies kept (policy_model's ``_apply``)
        to_dtype_keeping_frequencies(model, getattr(torch, spec.convert))
    if spec.gather_dtype and spec.autocast:
        gathered = getattr(torch, spec.gather_dtype)
        buffers = {name: buffer.dtype for name, buffer in model.named_buffers()}
        cast_to_forward_dtypes(model, gathered, getattr(torch, spec.autocast), buffers)
        model.sgrpo_gather_dtype = gathered  # an engine's weights_snapshot copy of it keeps these dtypes
    return model.to(spec.device)


def _sample_steps(spec: ProducerSpec, shared, version, lock, pushed, queues, asked, stop, parent, folder: str,
                  ready) -> None:  # fmt: skip
    """Sample each admitted step's groups under the newest weights, with the attention implementation the trainer's
    model had when it pushed them, and queue them; serve dynamic sampling's refill requests first, whenever they
    come."""
    from sgrpo.model.packed_path import use_attention
    from sgrpo.model.packing import attention_implementation

    blocks, refills = queues
    version, attention = version
    shared = weight_views(*shared)
    for out in queues:
        out.cancel_join_thread()  # ending, never wait to flush blocks into a pipe nobody reads (a dead trainer)
    torch.set_num_threads(spec.threads)
    model = sampling_model(spec)
    targets = dict(model.named_parameters(remove_duplicate=False))
    missing = set(targets) - set(shared) - {"lm_head.weight"}
    if missing:
        raise ProducerError(f"the trainer's weights lack {sorted(missing)[:3]}: the producer cannot copy them")
    device_type = torch.device(spec.device).type
    if device_type == "cuda":  # the trainer's GPU: CUDA graphs' streams and the current context there, not on GPU 0
        torch.cuda.set_device(torch.device(spec.device))
    autocast = (torch.autocast(device_type, dtype=getattr(torch, spec.autocast)) if spec.autocast
                else contextlib.nullcontext())  # fmt: skip
    ready.set()  # started: from now on the trainer's timeout counts
    held, idle, step = None, 0.0, spec.start_step

    def newest_weights() -> bool:
        """Copy the newest pushed weights into the model if it holds older ones; False once the trainer is gone."""
        nonlocal held
        if version.value == held:
            return True
        while not lock.acquire(timeout=0.25):
            if not _alive(parent):
                return False
        try:
            with torch.no_grad():
                for name, param in targets.items():
                    if name in shared:
                        param.copy_(shared[name])
            wanted = attention.value.decode()  # the synchronous rollout samples through the trainer's model as it is
            if wanted and wanted != attention_implementation(model):
                use_attention(model, wanted)
            held = version.value
        finally:
            lock.release()
        return True

    def send(out, at: int, prompts: list[Example], seed: int, sampling_round: int = 0) -> bool:
        """Sample ``prompts`` under the held weights with ``seed`` and queue them as a block; False once stopped."""
        nonlocal idle
        started = time.perf_counter()
        with torch.random.fork_rng(devices=[]), autocast:
            torch.manual_seed(seed)
            rollout = spec.engine.generate(model, spec.tokenizer, prompts, spec.group_size)
        rows = rollout.input_ids.shape[0]
        rollout = dataclasses.replace(rollout, versions=torch.full((rows,), held, device=rollout.input_ids.device))
        sample_s = time.perf_counter() - started
        if spec.delay_s:
            time.sleep(spec.delay_s)
        block = Block(at, held, [ex.prompt for ex in prompts], rollout, idle, sample_s, sampling_round)
        data, waiting, idle = _pack(block, folder), time.perf_counter(), 0.0
        while True:  # a full step queue never holds up a refill: the trainer asks for one only between its takes
            try:
                out.put(data, timeout=0.25)
                break
            except queue.Full:
                if stop.is_set() or not _alive(parent):
                    return False
        idle += time.perf_counter() - waiting
        return True

    waiting = time.perf_counter()
    while True:  # never blocks for good on a lock or event a dead trainer may hold: its end is checked
        pushed.clear()  # cleared before the checks: a push or request after it sets it again, and the wait returns
        if stop.is_set() or not _alive(parent):
            return
        if asked.poll():  # a refill round of the step the trainer is on: before any further step
            try:
                at, sampling_round = asked.recv()
            except EOFError:  # the trainer is gone
                return
            idle += time.perf_counter() - waiting
            if not newest_weights() or not send(refills, at, spec.refill_prompts(at, sampling_round),
                                                spec.seed_of(at, sampling_round), sampling_round):  # fmt: skip
                return
            waiting = time.perf_counter()
            continue
        if step < spec.end_step and admitted(step, version.value, spec.max_staleness):
            if not newest_weights():
                return
            idle += time.perf_counter() - waiting
            if spec.fault == f"die@{step}":
                os.kill(os.getpid(), 9)
            if spec.fault == f"hang@{step}":
                while _alive(parent) and not stop.is_set():
                    time.sleep(0.25)
                return
            if not send(blocks, step, spec.prompts(step), spec.seed_of(step)):
                return
            step, waiting = step + 1, time.perf_counter()
            continue
        pushed.wait(timeout=0.25)  # every step sampled: stays until the trainer took them (close)
