"""Asynchronous rollouts from vLLM servers: ``ServerProducer``, the producer of ``VLLMServerRollout``.

The trainer-side interface of ``sgrpo.rollout.producer.RolloutProducer`` (``push``, ``take``, ``close``,
``describe``), with the servers as the worker that holds its own weights: no producer process. In each trainer
process, daemon threads keep the requests of every admitted step in flight to the servers (least-outstanding
routing, ``VLLMServerRollout.pool``), while the trainer trains; only HTTP runs in those threads. The trainer's
thread admits steps, tokenizes their prompts, draws their seeds and builds each step's ``RolloutBatch``.

**Admission** is ``producer.admitted``'s: step s is sent once s <= v + S, v the trainer's version (its training
step count). A step's requests carry the synchronous path's seeds (one per request, drawn from torch's RNG seeded
with ``seed_of(step)``, as ``VLLMServerRollout.generate`` draws them under the synchronous seed): at S = 0 every
step is sent after the push of its own version, with nothing in flight, and samples the synchronous run's tokens.

**Weights** go after each training step through the engine's push (``VLLMServerRollout.sync_weights``: rank 0
pauses, transfers, resumes; every process gathers in step). With ``VLLMServerRollout.async_pause="keep"`` (the
default) the pause is vLLM's ``mode=keep``: requests in flight are frozen and continue under the new weights after
``/resume``, and each completion reports the weight versions its tokens were sampled under (vLLM's
``weight_versions`` spans). Each group records the oldest (``RolloutBatch.versions``: staleness counts from it;
every group is admitted within S of the trainer, so its oldest version is too) and the newest
(``RolloutBatch.newest_versions``). Its log-probs are the sampler's, token by token, whatever weights sampled each:
the decoupled objective (``sgrpo.train.correction``) takes them as the behaviour policy unchanged. A frozen request
keeps the KV cache computed under the weights it started with (as PipelineRL's in-flight updates do); vLLM does not
clear caches in this mode, so every request is salted with the version the servers hold when it is sent
(``cache_salt``): no request reads another version's prompt cache. ``async_pause="wait"``: the pause waits for the
requests in flight (``mode=wait``), so a group spans one version, at the cost of servers idle during the push.

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
from sgrpo.rollout.producer import Block, ProducerError, admitted
from sgrpo.rollout.vllm_http import Answer, ServerError, call
from sgrpo.rollout.vllm_requests import fitting_prompt_ids
from sgrpo.rollout.vllm_server import GENERATE, VLLMServerRollout
from sgrpo.types import Example

#: seconds between the ``/health`` checks of ``take`` while it waits
HEALTH_EVERY_S = 2.0


class _Job:
    """One step's requests: their answers fill in as they come (any thread); ``done`` once all came or one failed."""

    def __init__(self, step: int, prompts: list[Any], ids: list[list[int]], payloads: list[dict]) -> None:
        self.step, self.prompts, self.ids, self.payloads = step, prompts, ids, payloads
        self.answers: list[Any] = [None] * len(payloads)
        self.left, self.error = len(payloads), None
        self.done = threading.Event()
        self.sent = time.perf_counter()
        self.finished = self.sent


class ServerProducer:
    """The trainer's end of asynchronous rollouts from vLLM servers: ``push`` weights, ``take`` a step's groups.

    Args:
        engine: The servers (``VLLMServerRollout``), shared with the synchronous path and validation.
        model: The policy (its weights are pushed; every process calls ``push`` together).
        tokenizer: The policy's tokenizer (prompts become token ids in the trainer's thread).
        prompts: step -> this process's prompts of that step (the data stream).
        seed_of: step -> the synchronous path's sampling seed of that step on this process.
        group_size: Completions per prompt (G).
        max_staleness: S: step s is sent once s <= v + S.
        start_step, end_step: Steps start_step .. end_step - 1 are sampled; the weights now are version start_step.
        timeout: Seconds ``take`` waits for a step's answers before it raises (``model.producer_timeout``).

    The pause mode of each push is the engine's ``async_pause``: ``"keep"`` (requests continue across the push) or
    ``"wait"`` (the push waits for them).
    """

    def __init__(
        self,
        engine: VLLMServerRollout,
        model: nn.Module,
        tokenizer,
        prompts: Callable[[int], list[Example]],
        seed_of: Callable[[int], int],
        group_size: int,
        max_staleness: int,
        start_step: int,
        end_step: int,
        timeout: float = 600.0,
    ) -> None:
        self.engine, self.model, self.tokenizer = engine, model, tokenizer
        self.prompts, self.seed_of, self.group_size = prompts, seed_of, group_size
        self.max_staleness, self.end_step, self.timeout = max_staleness, end_step, timeout
        self.eos, self.pad = stop_and_pad_ids(model, tokenizer)
        self._jobs: dict[int, _Job] = {}
        self._work: queue.Queue = queue.Queue()  # (job, index) of each request to send, oldest step first
        self._lock = threading.Lock()
        self._in_flight, self._idle_since, self._idle = 0, time.perf_counter(), 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._labels: dict[str, int] = {}  # the servers' weight version label -> the trainer's version
        self._next = start_step
        engine.ready(model)  # healthy, and holding these weights (pushed now if they changed): version start_step
        self._labels[engine._pushed] = self._version = start_step
        self._admit()

    def describe(self) -> str:
        return f"the vLLM server producer ({', '.join(self.engine.pool.urls)})"

    # ------------------------------------------------------------------------------------------ trainer side
    def push(self, weights: Iterable[tuple[str, Tensor]] | None, version: int) -> float:
        """The model's weights, ``version`` (the trainer's training step count), to every server; seconds taken.

        ``weights`` (``RolloutProducer``'s argument) is not read: the engine gathers the model itself, in the
        servers' dtype, in buckets (``VLLMServerRollout.sync_weights``). Every process calls this together."""
        started = time.perf_counter()
        self.engine.sync_weights(self.model, pause=self.engine.async_pause)
        self._labels[self.engine._pushed] = self._version = version
        self._admit()
        return time.perf_counter() - started

    def take(self, step: int, prompts: list[Any]) -> Block:
        """Step ``step``'s groups (its prompts must be ``prompts``), once every answer came; raises naming the server
        when a request failed, a server stops answering ``/health``, or nothing came for ``timeout`` seconds."""
        job = self._jobs.get(step)
        if job is None or job.prompts != prompts:
            raise ProducerError(f"{self.describe()} has not sent step {step} with these prompts (sent: "
                                f"{sorted(self._jobs)}): the producer is out of step with the trainer")  # fmt: skip
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
        del self._jobs[step]
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
        return Block(step, int(oldest.min()), prompts, rollout, idle, job.finished - job.sent)

    def close(self) -> None:
        """Stop sending (requests in flight are left to end in their daemon threads); the servers stay up (the
        engine stops the ones it started)."""
        self._stop.set()
        for _ in self._threads:
            self._work.put(None)
        self._jobs.clear()

    # ------------------------------------------------------------------------------------------ internals
    def _admit(self) -> None:
        """Send every step now admitted (s <= v + S): prompts as ids, seeds as the synchronous path draws them."""
        while self._next < self.end_step and admitted(self._next, self._version, self.max_staleness):
            step, self._next = self._next, self._next + 1
            examples = self.prompts(step)
            ids = fitting_prompt_ids(self.tokenizer, examples, self.engine.max_model_len)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed_of(step))
                seeds = torch.randint(2**31 - 1, (len(ids),), device="cpu").tolist()
            payloads = self.engine.request_payloads(ids, seeds, self.group_size, self.eos, greedy=False,
                                                    cache_salt=self.engine._pushed)  # fmt: skip
            job = _Job(step, [ex.prompt for ex in examples], ids, payloads)
            self._jobs[step] = job
            for index in range(len(payloads)):
                self._work.put((job, index))
            self._grow(len(payloads))

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
            item = self._work.get()
            if item is None or self._stop.is_set():
                return
            job, index = item
            if job.error is not None:  # an earlier request of the step failed: its step raises anyway
                continue
            with self._lock:
                if not self._in_flight:
                    self._idle += time.perf_counter() - self._idle_since
                self._in_flight += 1
            url = pool.acquire()
            try:
                answer = call(url + GENERATE, job.payloads[index], pool.request_timeout, method="POST")
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
        fallback = self._version  # a row of no token has no span: the newest weights (it sampled nothing)
        rows = [[self._labels[v] for v in row] or [fallback] for row in spans]
        low = torch.tensor([min(r) for r in rows], device="cpu").view(-1, g)  # the batch is built on the CPU
        high = torch.tensor([max(r) for r in rows], device="cpu").view(-1, g)
        oldest = low.amin(1, keepdim=True).expand(-1, g).reshape(-1)
        newest = high.amax(1, keepdim=True).expand(-1, g).reshape(-1)
        if bool((oldest < step - self.max_staleness).any()):
            raise ProducerError(f"{self.describe()}: step {step} holds tokens of version {int(oldest.min())}, older "
                                f"than the bound S = {self.max_staleness} allows")  # fmt: skip
        return oldest.clone(), newest.clone()
