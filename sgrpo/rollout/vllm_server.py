"""``VLLMServerRollout``: rollouts from vLLM servers on devices (or machines) of their own, weights pushed by vLLM's
RL API.

Every process sends its own prompts, as token ids, to ``/inference/v1/generate`` (vLLM's token-in token-out
endpoint: no re-tokenization, completions as token ids with the sampler's log-probs and the weight versions that
sampled them), spread over the servers by least-outstanding routing (``sgrpo.rollout.vllm_http``). Before each
rollout every process checks each server's ``/health``, and the policy's weights are pushed when they changed
(``weights_version``) or a server lost them (restarted: its weight version is not the last one pushed): rank 0
decides and pushes (``sgrpo.rollout.vllm_push``), every process gathers in step. Every call has a timeout; a dead,
hung or restarted server raises naming its URL.

The engine is synchronous: ``generate`` is one round of requests. ``request_payloads`` and ``batch_from_answers``
are the two halves a producer (asynchronous rollouts) can drive itself.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Collection, Sequence
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn

from sgrpo.distributed import close_before_release
from sgrpo.rollout.engine import RolloutEngine, stop_and_pad_ids, weights_version
from sgrpo.rollout.vllm_http import Answer, ServerError, ServerPool, rank_world
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_push import CPUTransport, WeightTransport, dtype_of, push, server_versions
from sgrpo.rollout.vllm_requests import fitting_prompt_ids, rollout_batch_from_outputs, sampling_kwargs
from sgrpo.rollout.weightsync import as_dtype, engine_weights, unwrap
from sgrpo.types import Example, RolloutBatch

log = logging.getLogger(__name__)
GENERATE = "/inference/v1/generate"


class VLLMServerRollout(RolloutEngine):
    """Rollouts from vLLM servers: ones the user started (``urls``) or ones it starts itself (``launch``).

    Each ``generate``: health check; weights pushed if changed or a server restarted (rank 0 sends, every process
    gathers); one request per prompt (``n = G``, a seed per request drawn from torch's RNG, which GRPOPolicy seeds
    from (seed, step, rank): a run reproduces); answers checked to come from the weights just pushed.

    Log-probs are the sampler's after temperature when the servers run with ``--logprobs-mode processed_logprobs``
    (servers sgrpo starts do; start yours so); the loss corrects for vLLM's numerics as with ``VLLMRollout``.

    Args:
        urls: Base URLs of running servers (``http://host:port``), or null with ``launch``.
        launch: Servers to start on this machine (``sgrpo.rollout.vllm_launch.VLLMServers``), or null with ``urls``.
        max_new_tokens: Completion length cap in tokens.
        temperature: Sampling temperature (> 0; the loss uses the same).
        top_p: Nucleus sampling (1: off).
        top_k: Top-k sampling (0: off; refused for training).
        max_model_len: The servers' ``--max-model-len`` (null: the model's); prompt + completion tokens per row.
        dtype: The servers' weights dtype (``--dtype``): weights are gathered and sent in it.
        transport: How weights travel (null: ``CPUTransport``; ``NCCLTransport`` between GPUs; ``IPCTransport``
            to servers on the trainer's own GPUs).
        request_timeout: Seconds a generation request may take.
        sync_timeout: Seconds each step of a weight push (and any other call but health) may take.
        health_timeout: Seconds a server has to answer ``/health`` before each rollout.
        weight_chunk_mib: Size of a weight chunk (one gather bucket, one transfer).
        max_concurrency: Requests in flight from one process (over all servers).
        async_pause: With ``model.async_rollout``, vLLM's pause mode for the push after each step: ``"keep"``
            (requests in flight continue under the new weights; each group records the versions it spans) or
            ``"wait"`` (the push waits for them; a group spans one version). ``sgrpo.rollout.server_producer``.
    """

    samples_from_policy = False  # other weights, other kernels

    def __init__(
        self,
        urls: list[str] | None = None,
        launch: VLLMServers | None = None,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_model_len: int | None = None,
        dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
        transport: WeightTransport | None = None,
        request_timeout: float = 600.0,
        sync_timeout: float = 300.0,
        health_timeout: float = 10.0,
        weight_chunk_mib: float = 512.0,
        max_concurrency: int = 256,
        async_pause: Literal["keep", "wait"] = "keep",
    ) -> None:
        checks = [
            ((urls is None) != (launch is None), "give exactly one of urls (running servers) and launch (to start)"),
            (max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
            (math.isfinite(temperature) and temperature > 0, f"temperature must be > 0, got {temperature}"),
            (0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
            (top_k >= 0, f"top_k must be >= 0 (0 disables it), got {top_k}"),
            (max_model_len is None or max_model_len > max_new_tokens, "max_model_len must exceed max_new_tokens"),
            (min(request_timeout, sync_timeout, health_timeout) > 0, "request_timeout, sync_timeout and "
             f"health_timeout must be > 0, got {request_timeout}, {sync_timeout}, {health_timeout}"),  # fmt: skip
            (weight_chunk_mib > 0, f"weight_chunk_mib must be > 0, got {weight_chunk_mib}"),
            (max_concurrency >= 1, f"max_concurrency must be >= 1, got {max_concurrency}"),
            (async_pause in ("keep", "wait"), f"async_pause must be 'keep' or 'wait', got {async_pause!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for url in urls or []:
            if not (url.startswith("http://") or url.startswith("https://")) or url.rstrip("/").count("/") != 2:
                raise ValueError(f"urls: {url!r} is not a server base URL; write http://host:port")
        self.launch = launch
        self.pool = ServerPool(urls if urls is not None else launch.urls, request_timeout, sync_timeout)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.max_model_len, self.dtype = max_model_len, dtype
        self.transport = transport if transport is not None else CPUTransport()
        self.health_timeout, self.weight_chunk_mib = health_timeout, weight_chunk_mib
        self.max_concurrency, self.async_pause = max_concurrency, async_pause
        self._tag = uuid.uuid4().hex[:8]  # this trainer's weight versions: a server that reports another lost them
        self._pushed: str | None = None  # the weight version every server holds
        self._synced: tuple[int, int] | None = None  # (model, weights version) pushed
        self._connected = False
        #: each row's weight version in the last ``generate`` (vLLM's spans of the sampled tokens)
        self.last_weight_versions: list[str] = []
        #: each row's weight versions in the order its tokens were sampled (several: a push with pause="keep")
        self.last_weight_spans: list[list[str]] = []
        #: seconds of the last push (None: none yet) and how many pushes there were
        self.last_sync_seconds: float | None = None
        self.syncs = 0

    @property
    def max_total_tokens(self) -> int | None:
        return self.max_model_len

    def preflight(self) -> str | None:
        """Why this engine cannot run, checked before the model loads (``sgrpo.run.preflight``), or None: the
        transport can reach the servers (``WeightTransport.preflight``); the servers of ``urls`` answer ``/health``
        and report the sampler's log-probs (``sampler_problem``); ``launch``'s interpreter exists."""
        problem = self.transport.preflight(None if self.launch is not None else self.pool.urls)
        if problem:
            return problem
        if self.launch is not None:
            python = self.launch.python
            if python is not None and not os.access(python, os.X_OK):
                return f"launch.python: {python} is not an executable interpreter"
            return None
        try:
            self.pool.check_health(self.health_timeout)
            return sampler_problem(self.pool)
        except ServerError as err:
            return f"urls: {err}"

    # ------------------------------------------------------------------------------------------ generate
    def generate(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, greedy: bool = False
    ) -> RolloutBatch:
        eos, pad = stop_and_pad_ids(model, tokenizer)
        prompts = fitting_prompt_ids(tokenizer, examples, self.max_model_len)
        seeds = [None] * len(prompts) if greedy else torch.randint(2**31 - 1, (len(prompts),), device="cpu").tolist()
        self.ready(model)
        payloads = self.request_payloads(prompts, seeds, group_size, eos, greedy, cache_salt=self._pushed)
        answers = self.pool.map(GENERATE, payloads, workers=self.max_concurrency)
        device = next(model.parameters()).device
        return self.batch_from_answers(answers, prompts, group_size, pad, tokenizer, device)

    def request_payloads(
        self,
        prompts: list[list[int]],
        seeds: list[int | None],
        group_size: int,
        eos: list[int],
        greedy: bool,
        cache_salt: str | None = None,
    ) -> list[dict[str, Any]]:
        """One ``/inference/v1/generate`` request per prompt (token ids in, token ids and log-probs out).

        ``cache_salt`` (the weight version the servers hold): vLLM reuses prefix-cache blocks only between requests
        of one salt, so a request never reads a prompt's cache computed under other weights (a push with
        ``pause="keep"`` does not clear the cache)."""
        payloads = []
        for ids, seed in zip(prompts, seeds):
            params = sampling_kwargs(group_size=group_size, max_new_tokens=self.max_new_tokens,
                                     temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     stop_token_ids=eos, greedy=greedy, seed=seed)  # fmt: skip
            params = {k: v for k, v in params.items() if v is not None}
            payload = {"token_ids": list(ids), "sampling_params": params | {"detokenize": False}}
            payloads.append(payload if cache_salt is None else payload | {"cache_salt": cache_salt})
        return payloads

    def batch_from_answers(
        self,
        answers: list[Answer],
        prompts: list[list[int]],
        group_size: int,
        pad: int,
        tokenizer,
        device,
        accept: Collection[str] | None = None,
    ) -> RolloutBatch:
        """The servers' answers (in prompt order) as a ``RolloutBatch``; each row's weight version recorded in
        ``last_weight_versions`` and its spans, in token order, in ``last_weight_spans``. An answer from other
        weights than the last pushed (``accept``: than these, the asynchronous producer's pushes) raises (a server
        that restarted or was updated by someone else while it served)."""
        outputs, versions, spans_of_rows = [], [], []
        allowed = None if accept is None else set(accept)
        for answer, ids in zip(answers, prompts):
            choices = (answer.body or {}).get("choices")
            if not choices:
                raise ServerError(f"{answer.url}: answered without choices: {str(answer.body)[:200]}")
            samples = []
            for choice in choices:
                tokens = list(choice.get("token_ids") or [])
                content = (choice.get("logprobs") or {}).get("content")
                steps = None if content is None else [{c["token_id"]: SimpleNamespace(logprob=c["logprob"])}
                                                      for c in content]  # fmt: skip
                samples.append(SimpleNamespace(index=choice["index"], token_ids=tokens, logprobs=steps,
                                               finish_reason=choice.get("finish_reason"), text=""))  # fmt: skip
                ordered = [s["version"] for s in choice.get("weight_versions") or []]
                spans = set(ordered)
                if allowed is None and self._pushed is not None and spans and spans != {self._pushed}:
                    raise ServerError(f"{answer.url}: sampled with weight versions {sorted(spans)}, not the "
                                      f"{self._pushed} pushed: did the server restart, or another trainer push?")
                if allowed is not None and tokens and not spans:  # staleness would read as none: refused
                    raise ServerError(f"{answer.url}: answered without the weight versions of its tokens "
                                      "(weight_versions), which asynchronous rollouts count staleness by")
                if allowed is not None and not spans <= allowed:
                    raise ServerError(f"{answer.url}: sampled with weight versions {sorted(spans - allowed)}, which "
                                      "this trainer did not push: did the server restart, or another trainer push?")
                versions += [",".join(sorted(spans))] * (group_size // len(choices))
                spans_of_rows += [ordered] * (group_size // len(choices))
            outputs.append(SimpleNamespace(prompt_token_ids=ids, outputs=samples))
        self.last_weight_versions, self.last_weight_spans = versions, spans_of_rows
        return rollout_batch_from_outputs(outputs, group_size, pad, tokenizer, device)

    runs_episodes = True  # model.environment: sgrpo.rollout.vllm_server_episodes

    def generate_episodes(self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int,
                          environment, greedy: bool = False) -> RolloutBatch:  # fmt: skip
        from sgrpo.rollout.vllm_server_episodes import server_episodes

        return server_episodes(self, model, tokenizer, examples, group_size, environment, greedy)

    # ------------------------------------------------------------------------------------------ servers and sync
    def ready(self, model: nn.Module) -> None:
        """Servers started (``launch``, rank 0) and healthy; the policy's weights pushed if they changed or a server
        lost them. Every process calls this together (the push's gathers are collectives)."""
        world = rank_world()[1]
        if self.launch is not None and not self._connected:  # rank 0 starts them; the others learn how that went
            _decided_by_rank0(lambda: None if self.launch.processes else self._start_servers(model), world)
        self.pool.check_health(self.health_timeout)
        version = weights_version(unwrap(model))
        changed = version is None or self._synced != (id(unwrap(model)), version)
        stale = _decided_by_rank0(lambda: self._stale_servers(changed), world)
        if stale:
            self.sync_weights(model, only=None if changed else stale)

    def _stale_servers(self, changed: bool) -> list[str]:
        """Rank 0: the servers to push to (all if the weights changed; else those that lost them)."""
        if changed or self._pushed is None:
            return list(self.pool.urls)
        lost = self._restarted_servers()
        for url, held in lost.items():
            log.warning("VLLMServerRollout: %s holds weight version %s, not %s: it restarted; pushing all weights "
                        "to it", url, held, self._pushed)  # fmt: skip
        return list(lost)

    def _restarted_servers(self) -> dict[str, str | None]:
        """Rank 0: the servers that hold another weight version than the last push's (restarted since), and theirs."""
        return {url: held for url, held in server_versions(self.pool).items() if held != self._pushed}

    @torch.no_grad()
    def sync_weights(
        self, model: nn.Module, only: list[str] | None = None, pause: Literal["wait", "keep"] = "wait"
    ) -> None:
        """Push ``model``'s weights to every server (``only``: these); every process calls this together.
        ``pause``: vLLM's pause mode for the push (``sgrpo.rollout.vllm_push.push``)."""
        rank, world = rank_world()
        dtype = dtype_of(self.dtype)
        chunk = int(self.weight_chunk_mib * 2**20)
        if self._pushed is not None and not self.transport.rejoins:  # a push to a group with a member gone would hang
            restarted = only if only is not None else _decided_by_rank0(lambda: list(self._restarted_servers()), world)
            if restarted:
                raise ServerError(f"{', '.join(restarted)}: restarted; {type(self.transport).__name__} cannot bring a "
                                  "server back into its transfer group: restart the servers and resume the run "
                                  "(--ckpt_path last)")  # fmt: skip
        # new weights get a new version; a restarted server gets the others' weights and version
        version = f"sgrpo-{self._tag}-{self.syncs + 1}" if only is None or self._pushed is None else self._pushed
        start = time.perf_counter()

        def weights():
            return as_dtype(engine_weights(model, dtype, bucket_bytes=chunk), dtype)

        def send() -> str:
            push(self.pool, self.transport, weights(), version, chunk, sender=rank == 0, only=only, pause=pause)
            return version

        try:
            if not self._connected:  # a round of its own: rank 0's failure here reaches the others before any gather
                _decided_by_rank0(lambda: self.transport.connect(self.pool, weights, sender=rank == 0), world, True)
                self._connected = True
            version = _decided_by_rank0(send, world, everyone=True)  # rank 0's version: the one the servers hold
        except Exception:
            self._pushed = None  # a server may hold part of a push: the next rollout pushes everything again
            raise
        self._pushed, self.syncs = version, self.syncs + 1
        self.last_sync_seconds = time.perf_counter() - start
        v = weights_version(unwrap(model))
        self._synced = None if v is None else (id(unwrap(model)), v)

    def _start_servers(self, model: nn.Module) -> None:
        path = getattr(unwrap(model), "name_or_path", "") or self.launch.model
        if not path:
            raise ValueError("launch.model: the policy has no folder or hub id (name_or_path): name the model to serve")
        transport = self.transport
        self.launch.start(path, self.dtype, self.max_model_len, transport.server_args(), transport.server_env())
        close_before_release(self.close)

    def close(self) -> None:
        """Stop the servers this engine started (none if it connected to running ones)."""
        if self.launch is not None:
            self.launch.stop()
        self._pushed, self._synced, self._connected = None, None, False


def sampler_problem(pool: ServerPool) -> str | None:
    """Why a server of ``pool`` would answer other log-probs than the loss assumes, or None: each server's
    ``logprobs_mode`` (``GET /server_info``, a development endpoint sgrpo's RL calls need anyway) must be
    ``processed_logprobs``. vLLM's default, ``raw_logprobs``, is taken before temperature and top-p: at a temperature
    other than 1 every sampler log-prob, and so every importance ratio and mismatch metric, was off, silently
    (found by a review). A server whose answer does not say is let through."""
    for url in pool.urls:
        info = pool.get(url, "/server_info?config_format=json")
        config = info.get("vllm_config") if isinstance(info, dict) else None
        model = config.get("model_config") if isinstance(config, dict) else None
        mode = model.get("logprobs_mode") if isinstance(model, dict) else None
        if mode is not None and mode != "processed_logprobs":
            return (f"urls: {url} reports log-probs {mode}, not those of the distribution it samples from (after "
                    "temperature and top-p), which the loss's importance ratios take; start it with --logprobs-mode "
                    "processed_logprobs (docs/servers.md)")  # fmt: skip
    return None


def shared_servers_error(rollout: RolloutEngine, val_rollout: RolloutEngine) -> str | None:
    """Why ``val_rollout`` cannot be a second ``VLLMServerRollout`` on ``rollout``'s servers, or None.

    Each engine tags the weight versions it pushes, so each takes the other's push for a server's restart and pushes
    again; a transport that cannot bring a restarted server back into its group (``NCCLTransport``) raised at the
    first training rollout after a validation, telling the user to restart the servers and resume, which failed
    the same way (found by a review). Transports that rejoin only push once more per validation."""
    if val_rollout is rollout or not (isinstance(rollout, VLLMServerRollout) and
                                      isinstance(val_rollout, VLLMServerRollout)):  # fmt: skip
        return None
    shared = sorted(set(rollout.pool.urls) & set(val_rollout.pool.urls))
    stuck = [type(e.transport).__name__ for e in (rollout, val_rollout) if not e.transport.rejoins]
    if not shared or not stuck:
        return None
    return (f"model.val_rollout: a second VLLMServerRollout on model.rollout's servers ({', '.join(shared)}): each "
            f"pushes weights of its own, which the other takes for a restart, and {stuck[0]} cannot bring a "
            "restarted server back into its transfer group; give val_rollout: null (validation samples with "
            "model.rollout's settings) or servers of its own")  # fmt: skip


def _decided_by_rank0(action, world: int, everyone: bool = False) -> Any:
    """Run ``action`` on rank 0 (``everyone``: on every process, for its collectives) and return rank 0's result on
    every process. An error on rank 0 (a server that died, a chunk file that could not be written) raises there
    and, as a ``ServerError`` with its message, on every other process: none waits for a rank 0 that gave up."""
    rank = rank_world()[0]
    result, error = None, None
    try:
        result = action() if (everyone or rank == 0) else None
    except Exception as err:
        if world == 1 or rank != 0:
            raise
        error = err
    if world > 1:
        box = [(result, None if error is None else str(error)) if rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0)
        result, message = box[0]
        if error is not None:
            raise error
        if message is not None:
            raise ServerError(f"rank 0: {message}")
    return result
