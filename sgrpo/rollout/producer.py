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

import dataclasses
import multiprocessing.util
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from sgrpo.processes import running
from sgrpo.rollout.producer_process import Block, ProducerError, ProducerSpec, _produce
from sgrpo.rollout.shared_weights import shared_weights, weight_views

#: test hooks, read when a producer starts (``ProducerSpec.delay_s`` and ``fault``): seconds it sleeps after each
#: block it samples, and a fault ("die@STEP": SIGKILL itself before sampling STEP; "hang@STEP": stall there)
DELAY_ENV, FAULT_ENV = "SGRPO_TEST_PRODUCER_DELAY", "SGRPO_TEST_PRODUCER_FAULT"
#: seconds a producer may take to start (fork, model load) before ``take`` calls it hung, at least
STARTUP_S = 300.0
#: room for an attention implementation's name (``config._attn_implementation``) shared with the producer
ATTENTION_BYTES = 256


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
        shapes: (name, dtype, shape) of each weight (``sgrpo.model.lora.plain_layout``): the shared buffer laid out
            before the first weight is gathered, each copied as it comes (under FSDP2 one bucket on the device at a
            time); None: ``weights`` held whole first.
    """

    def __init__(
        self,
        spec: ProducerSpec,
        weights: Iterable[tuple[str, Tensor]],
        timeout: float = 600.0,
        shapes: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None,
    ) -> None:
        hooks = {"delay_s": float(os.environ.get(DELAY_ENV) or 0.0), "fault": os.environ.get(FAULT_ENV, "")}
        spec = dataclasses.replace(spec, **{k: v for k, v in hooks.items() if v})
        self.spec, self.timeout = spec, timeout
        context = producer_context()
        # one shared buffer for every weight: one file descriptor to the fork server, which refuses 252 or more
        self._flat, self._layout = shared_weights(weights, shapes)  # with shapes: each weight copied as it comes
        self._shared = weight_views(self._flat, self._layout)
        self._version = context.Value("q", spec.start_step, lock=False)
        # the trainer's attention implementation with the weights: its first update may switch it (choose_attention)
        self._attention = context.Array("c", ATTENTION_BYTES, lock=False)
        self._attention.value = (spec.attention or "").encode()
        self._lock, self._pushed = context.Lock(), context.Event()  # the shared weights' lock; "a push came"
        self._blocks = context.Queue(maxsize=spec.max_staleness + 1)  # paths of block files in self.folder
        self._refills = context.Queue(maxsize=1)  # dynamic sampling: the path of the refill block asked for
        self._asked, self._ask = context.Pipe(duplex=False)  # (step, round) of a refill, to the producer
        self.folder = tempfile.mkdtemp(prefix="sgrpo-producer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._stop, self._ready = context.Event(), context.Event()  # "stop"; "model loaded: the timeout counts"
        self._lifeline, self._held = context.Pipe(duplex=False)  # the producer's end reads EOF once we are gone
        self.process = context.Process(
            target=_produce,
            args=(spec, (self._flat, self._layout), (self._version, self._attention), self._lock, self._pushed,
                  (self._blocks, self._refills), self._asked, self._stop, self._lifeline, self.folder, self._ready),
            name="sgrpo-rollout-producer",
            daemon=True,
        )
        try:
            self.process.start()
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        # at the interpreter's exit without close: before multiprocessing's own exit hook, which SIGTERMs daemon
        # children (the producer ignores it) and then joins them with no timeout, forever
        self._close = multiprocessing.util.Finalize(
            self, _stop_producer, (self._stop, self._pushed, self.process, (self._blocks, self._refills), self.folder),
            exitpriority=10,
        )  # fmt: skip

    def describe(self) -> str:
        return f"the rollout producer (process {self.process.pid})"

    def push(self, weights: Iterable[tuple[str, Tensor]], version: int, attention: str | None = None) -> float:
        """Copy the trainer's weights of ``version`` (its training step count) to the producer, and the attention
        implementation its model samples with (``attention``; None: unchanged); seconds taken.

        Each weight is copied as ``weights`` yields it, under the lock the producer reads them under: under FSDP2 one
        gathered bucket of full tensors is on the device at a time, not the whole model. Raises ``ProducerError`` when
        the producer ended while it held their lock, or has held it for ``timeout`` seconds (hung in its copy)."""
        started = time.perf_counter()
        while not self._lock.acquire(timeout=0.2):  # a producer killed while copying never releases the lock
            if (code := exit_code(self.process)) is not None:
                raise ProducerError(f"{self.describe()} ended with exit code {code} while it copied "
                                    "the weights (-9: killed, e.g. out of memory)")  # fmt: skip
            if time.perf_counter() - started > self.timeout:
                raise ProducerError(f"{self.describe()} has held the weights' lock for {self.timeout:g} s: it hung "
                                    "while it copied them (raise model.producer_timeout if a copy takes that long)")
        try:
            for name, value in weights:  # gathered as they are iterated (FSDP2: collectives, every process in step)
                self._shared[name].copy_(value.detach())
            if attention is not None:
                self._attention.value = attention.encode()
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
        # the refill waits behind the draw in progress (at S >= 1 the producer is sampling a later step): two draws
        return self._receive(self._refills, step, sampling_round, prompts, draws=2)

    def _receive(self, blocks, step: int, sampling_round: int, prompts: list[Any], draws: int = 1) -> Block:
        begun = clock = time.perf_counter()  # clock: since when a ready producer owes a block
        while True:
            try:
                block = _unpack(blocks.get(timeout=0.2))
                break
            except queue.Empty:
                now = time.perf_counter()
                if (code := exit_code(self.process)) is not None:
                    raise ProducerError(
                        f"{self.describe()} ended with exit code {code} before it sent the groups "
                        f"of step {step} (a traceback above if it raised; -9: killed, e.g. out of memory)"
                    ) from None
                if not self._ready.is_set():  # still starting: the hang clock has not begun
                    clock = now
                    if now - begun > max(self.timeout, STARTUP_S):
                        raise ProducerError(
                            f"{self.describe()} did not load its model within {now - begun:.0f} s: it hangs"
                        ) from None
                elif now - clock > draws * self.timeout:
                    waited = f"step {step}" if draws == 1 else (f"a refill of step {step} (allowed {draws} x the "
                                                                 "timeout: the draw in progress, then its own)")
                    raise ProducerError(
                        f"{self.describe()} sent no groups for {now - clock:.0f} s (model.producer_timeout = "
                        f"{self.timeout:g}) while the trainer waited for {waited}: it hangs; raise "
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
        """Stop the producer process (at most a few seconds), then end it (once: a second call does nothing)."""
        self._close()


def _stop_producer(stop, pushed, process, queues, folder: str) -> None:
    """``RolloutProducer.close``'s work, also run at the interpreter's exit (``multiprocessing.util.Finalize``)."""
    stop.set()  # the producer sees it within 0.25 s wherever it waits, and ends without flushing its queue
    pushed.set()
    process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    elif exit_code(process) is None:  # the fork server died (255 read), the producer did not: no child of ours
        os.kill(process.pid, signal.SIGKILL)
    for out in queues:
        out.cancel_join_thread()
    shutil.rmtree(folder, ignore_errors=True)


def exit_code(process) -> int | None:
    """The producer's exit code, or None while it runs. Its parent is the fork server, which a SIGTERM to the whole
    process group (a preemption) ends while the producer, which ignores SIGTERM, samples on: multiprocessing then
    reads the server's closed pipe as exit code 255. So 255 counts only once the producer's pid is gone."""
    code = process.exitcode
    return None if code == 255 and running(process.pid) else code


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
