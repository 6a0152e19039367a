"""Asynchronous rollouts: a producer process that samples whole groups while the trainer trains.

``RolloutProducer`` (trainer side) spawns one process per data-parallel process. That process holds its own
copy of the weights (loaded from the model folder, then overwritten by every push), and samples the groups of
training step s, s + 1, ... with the synchronous path's seed of each step (``ProducerSpec.seed_of(step)``,
one ``generate`` call per step's share of prompts: at staleness 0 it draws the synchronous run's tokens). Each
step's share travels as one block (a file whose path goes through a bounded queue), its rows tagged with the
version they were sampled under (``RolloutBatch.versions``) and carrying the sampler's log-probs.

**Admission** (``admitted``): with S = ``max_staleness``, ``g`` groups per step and v the version of the newest
weights pushed (the trainer's training step count at its latest push: after every step, or every ``sync_every``
steps), a group is admitted for sampling only while accepted + running < (S + v + 1) g. The groups of one step
are admitted together (one seeded draw), so step s is sampled only once s <= v + S, under weights of version
w >= v >= s - S: every trained group has v_train - v_sampled = s - w <= S. With pushes every k steps the trainer
at version t holds back weights up to k - 1 versions newer than the producer's, so its own step t is admitted
only if k - 1 <= S (``GRPOPolicy`` refuses a larger ``sync_every``). Blocks are consumed oldest first; a group
is never split (a block is sampled under one version). Weights reach the producer through shared memory
(``push``), the newest replacing any the producer has not read yet.

**Dynamic sampling's refills** (``refill``): the trainer scores a step's groups, drops the zero-variance ones
(which releases their slots: the step's count is what the trainer keeps, not what was drawn) and asks for refill
round r of step s; the producer samples that round's prompts (``ProducerSpec.refill_prompts``) with the
synchronous path's seed of (s, r) before any further step, under its newest weights (version >= that of step s's
first draw, so still within S of step s), and sends them as one block of one version through a queue of their own.

**Faults**: the trainer raises ``ProducerError`` naming the producer when its process has ended, or when the
block it waits for has not come within ``timeout`` seconds (a hung producer); the producer ends itself when
its trainer process is gone (checked every 0.25 s between draws). Nothing of the producer is
checkpointed: its blocks are a function of (step, weights), so a resumed run restarts it at its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sgrpo.rollout.engine import RolloutEngine
from sgrpo.rollout.shared_weights import shared_weights, weight_views
from sgrpo.types import Example, RolloutBatch

#: test hooks, read when a producer starts (``ProducerSpec.delay_s`` and ``fault``): seconds it sleeps after each
#: block it samples, and a fault ("die@STEP": SIGKILL itself before sampling STEP; "hang@STEP": stall there)
DELAY_ENV, FAULT_ENV = "SGRPO_TEST_PRODUCER_DELAY", "SGRPO_TEST_PRODUCER_FAULT"
#: seconds a producer may take to start (fork, model load) before ``take`` calls it hung, at least
STARTUP_S = 300.0


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


def _unpack(path: str) -> Block:
    block = torch.load(path, weights_only=False)  # our own producer's file
    os.unlink(path)
    return block


class RolloutProducer:
    """The trainer's end of one producer process: ``start``, ``push`` weights, ``take`` a step's groups, ``close``.

    Args:
        spec: The producer's settings (``ProducerSpec``).
        weights: (name, tensor) of the model's plain weights (``sgrpo.model.lora.plain_weights``), version
            ``spec.start_step``; later pushes must give the same names and shapes.
        timeout: Seconds ``take`` waits for a block before it raises (a hung producer).
    """

    def __init__(self, spec: ProducerSpec, weights: Iterable[tuple[str, Tensor]], timeout: float = 600.0) -> None:
        hooks = {"delay_s": float(os.environ.get(DELAY_ENV) or 0.0), "fault": os.environ.get(FAULT_ENV, "")}
        spec = dataclasses.replace(spec, **{k: v for k, v in hooks.items() if v})
        self.spec, self.timeout = spec, timeout
        context = producer_context()
        # one shared buffer for every weight: one file descriptor to the fork server, which refuses 252 or more
        self._flat, self._layout = shared_weights(weights)
        self._shared = weight_views(self._flat, self._layout)
        self._version = context.Value("q", spec.start_step, lock=False)
        self._lock, self._pushed = context.Lock(), context.Event()  # the shared weights' lock; "a push came"
        self._blocks = context.Queue(maxsize=spec.max_staleness + 1)  # paths of block files in self.folder
        self._refills = context.Queue(maxsize=1)  # dynamic sampling: the path of the refill block asked for
        self._asked, self._ask = context.Pipe(duplex=False)  # (step, round) of a refill, to the producer
        self.folder = tempfile.mkdtemp(prefix="sgrpo-producer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._stop, self._ready = context.Event(), context.Event()  # "stop"; "model loaded: the timeout counts"
        self._lifeline, self._held = context.Pipe(duplex=False)  # the producer's end reads EOF once we are gone
        self.process = context.Process(
            target=_produce,
            args=(spec, (self._flat, self._layout), self._version, self._lock, self._pushed,
                  (self._blocks, self._refills), self._asked, self._stop, self._lifeline, self.folder, self._ready),
            name="sgrpo-rollout-producer",
            daemon=True,
        )
        try:
            self.process.start()
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def describe(self) -> str:
        return f"the rollout producer (process {self.process.pid})"

    def push(self, weights: Iterable[tuple[str, Tensor]], version: int) -> float:
        """Copy the trainer's weights of ``version`` (its training step count) to the producer; seconds taken.

        Each weight is copied as ``weights`` yields it, under the lock the producer reads them under: under FSDP2 one
        gathered bucket of full tensors is on the device at a time, not the whole model."""
        started = time.perf_counter()
        while not self._lock.acquire(timeout=0.2):  # a producer killed while copying never releases the lock
            if self.process.exitcode is not None:
                raise ProducerError(f"{self.describe()} ended with exit code {self.process.exitcode} while it copied "
                                    "the weights (-9: killed, e.g. out of memory)")  # fmt: skip
        try:
            for name, value in weights:  # gathered as they are iterated (FSDP2: collectives, every process in step)
                self._shared[name].copy_(value.detach())
            self._version.value = version
        finally:
            self._lock.release()
        self._pushed.set()
        return time.perf_counter() - started

    def take(self, step: int, prompts: list[Any]) -> Block:
        """The oldest block, which must be step ``step``'s with ``prompts``; raises ``ProducerError`` when the
        producer ended or sent nothing for ``timeout`` seconds once it was ready (its start, a fork and a model
        load that a loaded machine slows, has ``max(timeout, STARTUP_S)``)."""
        return self._receive(self._blocks, step, 0, prompts)

    def refill(self, step: int, sampling_round: int, prompts: list[Any]) -> Block:
        """Dynamic sampling's refill round ``sampling_round`` (>= 1) of step ``step``, whose prompts must be
        ``prompts``: asked for, sampled before the producer's next step, and waited for as ``take`` waits."""
        self._ask.send((step, sampling_round))
        self._pushed.set()  # wakes a producer waiting for admission
        return self._receive(self._refills, step, sampling_round, prompts)

    def _receive(self, blocks, step: int, sampling_round: int, prompts: list[Any]) -> Block:
        begun = clock = time.perf_counter()  # clock: since when a ready producer owes a block
        while True:
            try:
                block = _unpack(blocks.get(timeout=0.2))
                break
            except queue.Empty:
                now = time.perf_counter()
                if self.process.exitcode is not None:
                    raise ProducerError(
                        f"{self.describe()} ended with exit code {self.process.exitcode} before it sent the groups "
                        f"of step {step} (a traceback above if it raised; -9: killed, e.g. out of memory)"
                    ) from None
                if not self._ready.is_set():  # still starting: the hang clock has not begun
                    clock = now
                    if now - begun > max(self.timeout, STARTUP_S):
                        raise ProducerError(
                            f"{self.describe()} did not load its model within {now - begun:.0f} s: it hangs"
                        ) from None
                elif now - clock > self.timeout:
                    raise ProducerError(
                        f"{self.describe()} sent no groups for {now - clock:.0f} s (model.producer_timeout = "
                        f"{self.timeout:g}) while the trainer waited for step {step}: it hangs; raise "
                        f"model.producer_timeout if sampling one step takes longer"
                    ) from None
        versions = block.rollout.versions.view(-1, block.rollout.group_size)
        if (block.step, block.sampling_round, block.prompts) != (step, sampling_round, prompts) or bool(
            (versions != block.version).any()
        ):
            raise ProducerError(
                f"{self.describe()} sent the groups of step {block.step} (round {block.sampling_round}), but the "
                f"trainer is at step {step} (round {sampling_round}) or its prompts or versions differ: the "
                f"producer is out of step with the trainer"
            )
        return block

    def close(self) -> None:
        """Stop the producer process (at most a few seconds), then end it."""
        self._stop.set()  # the producer sees it within 0.25 s wherever it waits, and ends without flushing its queue
        self._pushed.set()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self._blocks.cancel_join_thread()
        self._refills.cancel_join_thread()
        shutil.rmtree(self.folder, ignore_errors=True)


def producer_context():
    """The multiprocessing context producers start in: a fork server (POSIX) that imported torch, transformers and the
    HF engine once, so that each producer starts without importing them again (about 15 s of CPU on a loaded
    2-core machine), from a process that never ran a torch thread pool; else ``spawn``."""
    methods = torch.multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["transformers", "sgrpo.rollout.hf", "sgrpo.rollout.producer"])
    return context


def _alive(lifeline) -> bool:
    """Whether the trainer process lives: it never writes to the pipe, so a readable end means it closed (EOF)."""
    return not lifeline.poll()


def _produce(spec: ProducerSpec, shared, version, lock, pushed, queues, asked, stop, parent, folder: str,
             ready) -> None:  # fmt: skip
    """The producer process (``_sample_steps``). A trainer that ended without ``close`` (an error in another
    interpreter's fit, ``os._exit``, a kill) leaves the block folder to it: it deletes it as it ends.

    It ignores SIGINT and SIGTERM: a signal to the job's process group (Ctrl-C, a scheduler's preemption) reaches
    the producer too, and the trainer, which stops at the end of its step, still waits for that step's groups;
    the producer ends by ``stop`` or by its trainer's end, as always."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    from sgrpo.model.loading import disable_dropout, load_causal_lm, resolve_model_path
    from sgrpo.rollout.snapshot import cast_to_forward_dtypes

    model = load_causal_lm(resolve_model_path(spec.model_path), getattr(torch, spec.dtype), spec.device)  # as trainer's
    disable_dropout(model)
    if spec.convert:
        model.to(getattr(torch, spec.convert))
    if spec.gather_dtype and spec.autocast:
        gathered = getattr(torch, spec.gather_dtype)
        buffers = {name: buffer.dtype for name, buffer in model.named_buffers()}
        cast_to_forward_dtypes(model, gathered, getattr(torch, spec.autocast), buffers)
        model.sgrpo_gather_dtype = gathered  # an engine's weights_snapshot copy of it keeps these dtypes
    return model.to(spec.device)


def _sample_steps(spec: ProducerSpec, shared, version, lock, pushed, queues, asked, stop, parent, folder: str,
                  ready) -> None:  # fmt: skip
    """Sample each admitted step's groups under the newest weights and queue them; serve dynamic sampling's
    refill requests first, whenever they come."""
    blocks, refills = queues
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
