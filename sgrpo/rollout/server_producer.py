"""Asynchronous rollouts from vLLM servers: ``ServerProducer``, the producer of ``VLLMServerRollout``.

The trainer-side interface of ``sgrpo.rollout.producer.RolloutProducer`` (``push``, ``take``, ``refill``,
``close``, ``describe``), with the servers as the worker that holds its own weights: no producer process. In each
trainer process, daemon threads keep the requests of every admitted step in flight to the servers
(least-outstanding routing, ``VLLMServerRollout.pool``), while the trainer trains; only HTTP runs in those threads.
The trainer's thread admits steps, tokenizes their prompts, draws their seeds and builds each step's
``RolloutBatch``.

**Admission** is ``producer.admitted``'s: step s is sent once s <= v + S, v the trainer's version (its training
step count). A step's requests carry the synchronous path's seeds (one per request, drawn from torch's RNG seeded
with ``seed_of(step)``, as ``VLLMServerRollout.generate`` draws them under the synchronous seed): at S = 0 every
step is sent when the trainer takes it (after the push of its version and any validation), with nothing in flight,
and samples the synchronous run's tokens.

**Weights** go after each training step, or every ``model.sync_every`` steps (the trainer calls ``push`` then;
admission counts from the last push's version, as the producer process's does), through the engine's push
(``VLLMServerRollout.sync_weights``: rank 0 pauses, transfers, resumes; every process gathers in step). With
``VLLMServerRollout.async_pause="keep"`` (the default) the pause is vLLM's ``mode=keep``: requests in flight are
frozen and continue under the new weights after ``/resume``, and each completion reports the weight versions its
tokens were sampled under (vLLM's ``weight_versions`` spans). Each group records the oldest
(``RolloutBatch.versions``: staleness counts from it; every group is admitted within S of the trainer, so its oldest
version is too) and the newest (``RolloutBatch.newest_versions``). Its log-probs are the sampler's, token by token,
whatever weights sampled each: the decoupled objective (``sgrpo.train.correction``) takes them as the behaviour
policy unchanged. A frozen request keeps the KV cache computed under the weights it started with (as PipelineRL's
in-flight updates do); vLLM does not clear caches in this mode, so every request is salted with the version the
servers hold when it leaves (``cache_salt``; no request of this process leaves during its push). A request may
still read the prompt cache of the version before its own where it left before a push but waits in a server's queue
when the push lands (it starts under the new weights, salted with the old), or where it leaves while another
process's push has paused the servers (under several processes the others may still be training then).
``async_pause="wait"``: the pause waits for the requests in flight (``mode=wait``), so a group spans one version, at
the cost of servers idle during the push.

**Dynamic sampling's refills** (``refill``): round r of step s is asked for by the trainer once it dropped the
step's zero-variance groups; its prompts are the synchronous path's (``refill_prompts(s, r)``, the refill stream)
and its seeds are drawn from ``seed_of(s, r)`` as ``VLLMServerRollout.generate`` draws them. Its requests go to
the front of the queue of requests not yet sent (before any later step's: requests already at the servers stay
there), under the weights the servers hold (of a version >= step s's first draw, so within S of step s), and the
trainer waits for them as ``take`` waits. At S = 0 nothing else is in flight: the synchronous run's refills.

**A push the producer did not make**: validation samples from the same engine, which pushes the trainer's weights
first if they changed since the last push (only between pushes, i.e. with ``sync_every`` > 1). Its weight version
is adopted as the trainer's version of that moment (``trainer_version``): requests that leave after it (queued
ones, refills) sample under those (newer) weights and record their version; admission counts from the last ``push``.

**Faults**: a request that fails (a dead or restarted server: connection refused or reset; an HTTP error; an
answer from weights this trainer did not push) raises in ``take`` naming the server; ``take`` checks every
server's ``/health`` every few seconds while it waits (``health_timeout``: a hung server raises naming it) and
raises ``ProducerError`` naming the servers with requests in flight after ``timeout`` seconds without the step's
answers. The threads are daemons: a hung request never holds the process at exit.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from sgrpo.rollout.engine import stop_and_pad_ids
from sgrpo.rollout.producer_process import Block, ProducerError, admitted
from sgrpo.rollout.vllm_http import Answer, ServerError, call
from sgrpo.rollout.vllm_requests import fitting_prompt_ids
from sgrpo.rollout.vllm_server import GENERATE, VLLMServerRollout
from sgrpo.types import Example

#: seconds between the ``/health`` checks of ``take`` while it waits
HEALTH_EVERY_S = 2.0


class _Job:
    """One step's (or refill round's) requests: their answers fill in as they come (any thread); ``done`` once all
    came or one failed."""

    def __init__(self, step: int, prompts: list[Any], ids: list[list[int]], payloads: list[dict],
                 sampling_round: int = 0) -> None:  # fmt: skip
        self.step, self.prompts, self.ids, self.payloads, self.round = step, prompts, ids, payloads, sampling_round
        self.answers: list[Any] = [None] * len(payloads)
        self.left, self.error = len(payloads), None
        self.done = threading.Event()
        self.sent = time.perf_counter()
        self.finished = self.sent


class ServerProducer:
    """The trainer's end of asynchronous rollouts from vLLM servers: ``push`` weights, ``take`` a step's groups,
    ``refill`` a dynamic-sampling round.

    Args:
        engine: The servers (``VLLMServerRollout``), shared with the synchronous path and validation.
        model: The policy (its weights are pushed; every process calls ``push`` together).
        tokenizer: The policy's tokenizer (prompts become token ids in the trainer's thread).
        prompts: step -> this process's prompts of that step (the data stream).
        seed_of: (step[, round]) -> the synchronous path's sampling seed of that step (dynamic sampling's round) on
            this process.
        group_size: Completions per prompt (G).
        max_staleness: S: step s is sent once s <= v + S.
        start_step, end_step: Steps start_step .. end_step - 1 are sampled; the weights now are version start_step.
        timeout: Seconds ``take`` waits for a step's answers before it raises (``model.producer_timeout``).
        refill_prompts: (step, round >= 1) -> this process's prompts of dynamic sampling's refill round (null: no
            refills; ``refill`` raises). ``seed_of(step, round)`` is then its seed.
        trainer_version: () -> the trainer's version now (its training step count): the version of a push made by
            the engine itself (validation between two ``push`` calls). Null: the last ``push``'s.

    The pause mode of each push is the engine's ``async_pause``: ``"keep"`` (requests continue across the push) or
    ``"wait"`` (the push waits for them).
    """

    def __init__(
        self,
        engine: VLLMServerRollout,
        model: nn.Module,
        tokenizer,
        prompts: Callable[[int], list[Example]],
        seed_of: Callable[..., int],
        group_size: int,
        max_staleness: int,
        start_step: int,
        end_step: int,
        timeout: float = 600.0,
        refill_prompts: Callable[[int, int], list[Example]] | None = None,
        trainer_version: Callable[[], int] | None = None,
    ) -> None:
        self.engine, self.model, self.tokenizer = engine, model, tokenizer
        self.refill_prompts, self.trainer_version = refill_prompts, trainer_version
        self.prompts, self.seed_of, self.group_size = prompts, seed_of, group_size
        self.max_staleness, self.end_step, self.timeout = max_staleness, end_step, timeout
        self.eos, self.pad = stop_and_pad_ids(model, tokenizer)
        self._jobs: dict[int, _Job] = {}
        self._work: queue.PriorityQueue = queue.PriorityQueue()  # each request to send, oldest (step, round) first
        self._queued = 0  # requests queued so far: ties in the queue go first come, first served
        self._lock = threading.Lock()
        self._in_flight, self._idle_since, self._idle = 0, time.perf_counter(), 0.0
        self._stop, self._leave = threading.Event(), threading.Event()  # "stop"; "requests may leave" (no push)
        self._leave.set()
        self._threads: list[threading.Thread] = []
        self._labels: dict[str, int] = {}  # the servers' weight version label -> the trainer's version
        self._next = start_step
        engine.ready(model)  # healthy, and holding these weights (pushed now if they changed): version start_step
        self._labels[engine._pushed] = self._version = start_step
        if max_staleness:  # at S = 0 a step leaves when the trainer takes it (``_admit``)
            self._admit()

    def describe(self) -> str:
        return f"the vLLM server producer ({', '.join(self.engine.pool.urls)})"

    # ------------------------------------------------------------------------------------------ trainer side
    def push(self, weights: Iterable[tuple[str, Tensor]] | None, version: int, attention: str | None = None) -> float:
        """The model's weights, ``version`` (the trainer's training step count), to every server; seconds taken.

        ``weights`` and ``attention`` (``RolloutProducer``'s arguments) are not read: the engine gathers the model
        itself, in the servers' dtype, in buckets (``VLLMServerRollout.sync_weights``), and vLLM runs its own
        attention, as in the synchronous run. Every process calls this together."""
        started = time.perf_counter()
        self._leave.clear()  # no request leaves during the push: each is salted with the version it will run under
        try:
            self.engine.sync_weights(self.model, pause=self.engine.async_pause)
            self._labels[self.engine._pushed] = self._version = version
        finally:
            self._leave.set()
        if self.max_staleness:
            self._admit()
        return time.perf_counter() - started

    def take(self, step: int, prompts: list[Any]) -> Block:
        """Step ``step``'s groups (its prompts must be ``prompts``), once every answer came; raises naming the server
        when a request failed, a server stops answering ``/health``, or nothing came for ``timeout`` seconds."""
        if not self.max_staleness:
            self._admit()
        job = self._jobs.get(step)
        if job is None or job.prompts != prompts:
            raise ProducerError(f"{self.describe()} has not sent step {step} with these prompts (sent: "
                                f"{sorted(self._jobs)}): the producer is out of step with the trainer")  # fmt: skip
        block = self._receive(job)
        del self._jobs[step]
        return block

    def refill(self, step: int, sampling_round: int, prompts: list[Any]) -> Block:
        """Dynamic sampling's refill round ``sampling_round`` (>= 1) of step ``step``, whose prompts must be
        ``prompts``: sent now, ahead of every request not yet sent, and waited for as ``take`` waits."""
        if self.refill_prompts is None:
            raise ProducerError(f"{self.describe()} was started without dynamic sampling's refill prompts")
        examples = self.refill_prompts(step, sampling_round)
        if [ex.prompt for ex in examples] != prompts:
            raise ProducerError(f"{self.describe()}: refill round {sampling_round} of step {step} has other prompts "
                                "than the trainer's: the producer is out of step with the trainer")  # fmt: skip
        return self._receive(self._send(step, examples, sampling_round))

    def _receive(self, job: _Job) -> Block:
        """``job``'s groups as a block, once every answer came (raising as ``take`` says)."""
        step = job.step
        begun = checked = time.perf_counter()
        while not job.done.wait(timeout=0.2):
            now = time.perf_counter()
            if now - begun > self.timeout:
                busy = [url for url, n in self.engine.pool.outstanding().items() if n] or self.engine.pool.urls
                raise ProducerError(
                    f"{self.describe()}: no answers for step {step} within {now - begun:.0f} s (model.producer_timeout"
                    f" = {self.timeout:g}); requests in flight to {', '.join(busy)}: the server hangs"
                )
            if now - checked > HEALTH_EVERY_S:
                self._check_health(step)
                checked = now
        if job.error is not None:
            raise ProducerError(f"{self.describe()}: step {step}'s requests failed: {job.error}") from job.error
        self._adopt_engine_push()
        try:
            rollout = self.engine.batch_from_answers(job.answers, job.ids, self.group_size, self.pad, self.tokenizer,
                                                     torch.device("cpu"), accept=self._labels)  # fmt: skip
        except ServerError as err:
            raise ProducerError(f"{self.describe()}: {err}") from err
        oldest, newest = self._group_versions(self.engine.last_weight_spans, step)
        rollout = dataclasses.replace(rollout, versions=oldest, newest_versions=newest)
        with self._lock:  # seconds since the previous block with no request of this process in flight
            now = time.perf_counter()
            idle = self._idle + (0.0 if self._in_flight else now - self._idle_since)
            self._idle = 0.0
            if not self._in_flight:
                self._idle_since = now
        return Block(step, int(oldest.min()), job.prompts, rollout, idle, job.finished - job.sent, job.round)

    def close(self) -> None:
        """Stop sending (requests in flight are left to end in their daemon threads); the servers stay up (the
        engine stops the ones it started)."""
        self._stop.set()
        for _ in self._threads:
            self._work.put(((-1, 0), 0, 0, None))  # first out: the threads end
        self._jobs.clear()

    # ------------------------------------------------------------------------------------------ internals
    def _admit(self) -> None:
        """Send every step now admitted (s <= v + S): after each push, and at S = 0 only when the trainer takes it,
        so that nothing of the step shares the servers with the trainer's validation (vLLM's numerics depend on
        the batch a request runs in: the synchronous run samples the step after validation)."""
        while self._next < self.end_step and admitted(self._next, self._version, self.max_staleness):
            step, self._next = self._next, self._next + 1
            self._jobs[step] = self._send(step, self.prompts(step))

    def _send(self, step: int, examples: list[Example], sampling_round: int = 0) -> _Job:
        """Queue the requests of ``examples`` (step ``step``, dynamic sampling's round ``sampling_round``): prompts as
        ids, seeds as the synchronous path draws them, salted with the servers' weight version."""
        ids = fitting_prompt_ids(self.tokenizer, examples, self.engine.max_model_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed_of(step, sampling_round) if sampling_round else self.seed_of(step))
            seeds = torch.randint(2**31 - 1, (len(ids),), device="cpu").tolist()
        payloads = self.engine.request_payloads(ids, seeds, self.group_size, self.eos, greedy=False,
                                                cache_salt=self.engine._pushed)  # fmt: skip
        job = _Job(step, [ex.prompt for ex in examples], ids, payloads, sampling_round)
        for index in range(len(payloads)):
            self._queued += 1
            self._work.put(((step, sampling_round), self._queued, index, job))
        self._grow(len(payloads))
        return job

    def _adopt_engine_push(self) -> None:
        """A weight version the engine pushed itself (validation between two ``push`` calls, with ``sync_every`` >
        1): the trainer's version now, or the last ``push``'s without ``trainer_version``."""
        if self.engine._pushed is not None and self.engine._pushed not in self._labels:
            now = self._version if self.trainer_version is None else self.trainer_version()
            self._labels[self.engine._pushed] = now

    def _grow(self, requests: int) -> None:
        """Enough sender threads for every queued request, up to the engine's ``max_concurrency``."""
        want = min(self.engine.max_concurrency, len(self._threads) + requests, self._work.qsize() + len(self._threads))
        while len(self._threads) < want:
            thread = threading.Thread(target=self._send_loop, name="sgrpo-server-producer", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _send_loop(self) -> None:
        pool = self.engine.pool
        while not self._stop.is_set():
            _, _, index, job = self._work.get()
            if job is None or self._stop.is_set():
                return
            if job.error is not None:  # an earlier request of the step failed: its step raises anyway
                continue
            while not self._leave.wait(timeout=0.25):
                if self._stop.is_set():
                    return
            payload = job.payloads[index]
            if self.engine._pushed is not None:  # the version the servers hold now, which this request runs under
                payload = payload | {"cache_salt": self.engine._pushed}
            with self._lock:
                if not self._in_flight:
                    self._idle += time.perf_counter() - self._idle_since
                self._in_flight += 1
            url = pool.acquire()
            try:
                answer = call(url + GENERATE, payload, pool.request_timeout, method="POST")
                job.answers[index] = Answer(url, answer)
            except Exception as err:  # noqa: BLE001 - handed to the trainer's take, which raises it
                job.error = err if isinstance(err, ServerError) else ServerError(f"{url}: {err}")
                job.done.set()
            finally:
                pool.release(url)
                with self._lock:
                    self._in_flight -= 1
                    if not self._in_flight:
                        self._idle_since = time.perf_counter()
                    job.left -= 1
                    if job.left == 0:
                        job.finished = time.perf_counter()
                        job.done.set()

    def _check_health(self, step: int) -> None:
        try:
            self.engine.pool.check_health(self.engine.health_timeout)
        except ServerError as err:
            raise ProducerError(f"{self.describe()}: while the trainer waited for step {step}: {err}") from err

    def _group_versions(self, spans: list[list[str]], step: int) -> tuple[Tensor, Tensor]:
        """``[N]`` oldest and newest trainer version over each row's group (a group is one unit: one span)."""
        g = self.group_size
        fallback = self._version  # only a row of no token has no span (batch_from_answers): it sampled nothing
        rows = [[self._labels[v] for v in row] or [fallback] for row in spans]
        low = torch.tensor([min(r) for r in rows], device="cpu").view(-1, g)  # the batch is built on the CPU
        high = torch.tensor([max(r) for r in rows], device="cpu").view(-1, g)
        oldest = low.amin(1, keepdim=True).expand(-1, g).reshape(-1)
        newest = high.amax(1, keepdim=True).expand(-1, g).reshape(-1)
        if bool((oldest < step - self.max_staleness).any()):
            raise ProducerError(f"{self.describe()}: step {step} holds tokens of version {int(oldest.min())}, older "
                                f"than the bound S = {self.max_staleness} allows")  # fmt: skip
        return oldest.clone(), newest.clone()
