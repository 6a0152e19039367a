"""Pushing the policy's weights into vLLM servers with vLLM's own RL API (``vllm/entrypoints/rl/online``).

One push, on every server: ``POST /pause?mode=wait`` (in-flight requests finish, caches cleared; the asynchronous
producer's ``mode=keep``: in-flight requests frozen, continued under the new weights),
``/start_weight_update``, the transport's ``/update_weights`` calls, ``/finish_weight_update`` with the new
weight version, ``/resume``. Only the sending process (rank 0) talks to the servers; every process iterates the
weights (``sgrpo.rollout.weightsync.engine_weights``: HF names, FSDP2 shards gathered in step, in buckets, in the
server's dtype, LoRA merged), so the gathers stay collective. Each HTTP call has ``ServerPool.timeout``.

A failed push leaves no server stuck in the middle of an update (``PushCalls``): a server whose call fails (an
error, no answer within the timeout) is left out of the rest of the push, the others get every weight, the new
version and ``/resume``, then the push raises naming it. vLLM 0.32 has no call that aborts an update, and refuses
a second ``/start_weight_update`` while one is active; a push that finds a server in an update (a push that failed
before finishing it, this trainer's or an earlier run's) carries on in that update: it sends every weight, so the
finish completes it. When the transfer itself fails (a chunk file that cannot be written, an NCCL error), the
sender still iterates the weights to their end (the other processes' gathers) and the servers stay paused in the
update, which the next push completes.

Transports (``WeightTransport`` subclasses, the server's ``--weight-transfer-config`` backend):
  - ``CPUTransport`` (``sgrpo_cpu``, sgrpo's own engine ``sgrpo.rollout.vllm_cpu_engine``): each chunk a safetensors
    file in a folder trainer and servers share (``/dev/shm`` on one machine); has run, on CPU (``make test-vllm``).
  - ``NCCLTransport`` (vLLM's ``nccl``): vLLM's trainer engine broadcasts from rank 0's GPU to every server's GPUs;
    written against vLLM 0.32's API, not yet run (no GPU with vLLM at hand).
  - ``IPCTransport`` (vLLM's ``ipc``, ``sgrpo.rollout.vllm_ipc``): servers on the trainer's own GPUs read the
    weights from its memory by CUDA IPC handles; written against vLLM 0.32's API, not yet run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from sgrpo.processes import running
from sgrpo.rollout.vllm_http import ServerError, ServerPool
from sgrpo.rollout.vllm_plugin import CPU_BACKEND
from sgrpo.rollout.weightsync import weight_chunks

Weights = Iterable[tuple[str, Tensor]]
log = logging.getLogger(__name__)

#: vLLM 0.32's refusal of ``/start_weight_update`` while an update is active (``Worker._start_weight_update``,
#: vllm/v1/worker/gpu_worker.py: "start_weight_update called while a weight update is already active. Call
#: finish_weight_update first."), in the HTTP 500 answer's message
UPDATE_ACTIVE = "weight update is already active"


class WeightTransport(ABC):
    """How weight chunks travel from the trainer's rank 0 to the servers (a vLLM weight-transfer backend)."""

    #: the backend name the servers are started with: ``--weight-transfer-config '{"backend": NAME}'``
    backend: ClassVar[str]
    #: the transport calls ``/start_weight_update`` and ``/finish_weight_update`` itself (vLLM's trainer engines)
    drives_update: ClassVar[bool] = False
    #: a restarted server can get a push of its own (no group to re-join); NCCL's group spans every server
    rejoins: ClassVar[bool] = True

    def server_args(self) -> list[str]:
        """Arguments a server started by sgrpo gets for this transport."""
        return ["--weight-transfer-config", json.dumps({"backend": self.backend})]

    def server_env(self) -> dict[str, str]:
        """Environment variables a server started by sgrpo gets for this transport."""
        return {}

    def preflight(self, urls: list[str] | None) -> str | None:
        """Why this transport cannot work with these servers (``urls``; None: servers sgrpo starts on this machine),
        checked before the model loads, or None."""
        return None

    @abstractmethod
    def connect(self, pool: ServerPool, weights: Callable[[], Weights], sender: bool) -> None:
        """Set the transfer up (``/init_weight_transfer_engine``) on every server; called on every process."""

    @abstractmethod
    def send(self, calls: PushCalls, weights: Weights, chunk_bytes: int, sender: bool) -> None:
        """Send ``weights`` between ``/start_weight_update`` and ``/finish_weight_update`` (which ``push`` calls),
        through ``calls`` (a server that fails is left out of the rest). Non-senders only iterate ``weights`` (their
        gathers are collectives)."""


def each_server(pool: ServerPool, action: Callable[[str], Any]) -> list[Any]:
    """``action(url)`` on every server at once; the first ``ServerError`` (naming its URL) raises."""
    with ThreadPoolExecutor(max_workers=len(pool.urls)) as executor:
        return list(executor.map(action, pool.urls))


class PushCalls:
    """The RL calls of one push, from the sender, on its servers. A call that fails on a server (an error answer, no
    answer within the timeout, a dead server) records its first error and leaves that server out of the rest of
    the push; ``raise_failure`` raises it once the others are done, naming the server."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool, self.failures = pool, {}

    @property
    def live(self) -> list[str]:
        """The servers no call has failed on yet."""
        return [url for url in self.pool.urls if url not in self.failures]

    def each(self, action: Callable[[str], Any]) -> None:
        """``action(url)`` on every live server at once; a ``ServerError`` leaves its server out."""

        def run(url: str) -> None:
            try:
                action(url)
            except ServerError as err:
                self.failures.setdefault(url, err)
            except Exception as err:  # whatever else one server's call raised leaves that server out, not the push
                self.failures.setdefault(url, ServerError(f"{url}: {type(err).__name__}: {err}"))

        live = self.live
        if live:
            with ThreadPoolExecutor(max_workers=len(live)) as executor:
                list(executor.map(run, live))

    def post(self, path: str, payload: Any = None, timeout: float | None = None) -> None:
        """POST ``payload`` to ``path`` of every live server (within the pool's timeout, or ``timeout``)."""
        self.each(lambda url: self.pool.post(url, path, payload, timeout))

    def start(self) -> None:
        """``/start_weight_update`` on every live server. One that refuses because it is still in an update (a push
        that failed before finishing it) carries on in that update: the push sends every weight into it and the
        finish completes it."""

        def start(url: str) -> None:
            try:
                self.pool.post(url, "/start_weight_update")
            except ServerError as err:
                if UPDATE_ACTIVE not in str(err):
                    raise
                log.warning("%s was still in a weight update (a push that failed before finishing it): this push "
                            "sends every weight into it and finishes it", url)  # fmt: skip

        self.each(start)

    def raise_failure(self) -> None:
        """Raise the first failure (naming its server, and the others that failed), if any."""
        if not self.failures:
            return
        first, *others = self.failures.values()
        if not others:
            raise first
        raise ServerError(f"{first} (also failed: {'; '.join(str(e) for e in others)})")


def push(
    pool: ServerPool,
    transport: WeightTransport,
    weights: Weights,
    version: str,
    chunk_bytes: int,
    sender: bool,
    only: list[str] | None = None,
    pause: Literal["wait", "keep"] = "wait",
) -> None:
    """Pause, transfer, finish with ``version``, resume: on every server (``only``: these), from the sender.

    ``pause``: vLLM's pause mode. ``"wait"``: requests in flight finish first, then the caches are cleared (the
    synchronous engine). ``"keep"``: requests in flight are frozen where they are and continue under the new
    weights after ``/resume`` (their tokens' weight-version spans record the switch; vLLM does not clear the
    caches in this mode: the asynchronous producer salts its requests' prefix cache with the version instead).

    A server that fails is left out of the rest; the others get every weight, ``version`` and ``/resume``, then the
    first failure raises, naming its server. A transfer that fails as a whole (the transport raises) leaves the
    servers paused in the update (the next push completes it: ``PushCalls.start``) once the sender has iterated
    ``weights`` to their end, as the other processes do."""
    servers = ServerPool(only, pool.request_timeout, pool.timeout) if only else pool
    calls = PushCalls(servers)
    if not sender:
        transport.send(calls, weights, chunk_bytes, sender=False)
        return
    stream = iter(weights)
    try:
        if pause == "keep":
            calls.post("/pause?mode=keep&clear_cache=false")
        else:  # requests in flight finish first: as long as a generation request may take
            calls.post("/pause?mode=wait&clear_cache=true", timeout=max(servers.timeout, servers.request_timeout))
        if not transport.drives_update:
            calls.start()
        transport.send(calls, stream, chunk_bytes, sender=True)
    except Exception:
        for _ in stream:  # the other processes' gathers are collectives: iterate to the end with them
            pass
        raise
    if transport.drives_update:
        calls.post("/update_weight_version", {"new_version": version})
    else:
        calls.post("/finish_weight_update", {"weight_version": version})
    calls.post("/resume")
    calls.raise_failure()


def server_versions(pool: ServerPool) -> dict[str, str | None]:
    """Each server's weight version (``GET /weight_info``)."""
    versions = each_server(pool, lambda url: (pool.get(url, "/weight_info") or {}).get("weight_version"))
    return dict(zip(pool.urls, versions))


class CPUTransport(WeightTransport):
    """Chunks as safetensors files in ``folder``, which the trainer's rank 0 and every server must see (sgrpo's own
    ``sgrpo_cpu`` backend; install sgrpo in the servers' environment so vLLM loads its plugin).

    Args:
        folder: Where the chunk files go (null: ``/dev/shm`` where it exists, else the temp folder): the same
            machine, or a shared filesystem. A file is deleted once every server has loaded it; in the default
            folder the first push also deletes those a trainer killed mid-push left (``sweep_stale_chunks``).
    """

    backend = CPU_BACKEND

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder
        self._swept = False

    def connect(self, pool: ServerPool, weights: Callable[[], Weights], sender: bool) -> None:
        if sender:
            each_server(pool, lambda url: pool.post(url, "/init_weight_transfer_engine", {"init_info": {}}))

    def send(self, calls: PushCalls, weights: Weights, chunk_bytes: int, sender: bool) -> None:
        if not sender:
            for _ in weights:  # the gathers are collectives: iterate in step with the sender
                pass
            return
        from safetensors.torch import save_file

        folder = self.folder or default_chunk_folder()
        os.makedirs(folder, exist_ok=True)
        if self.folder is None and not self._swept:
            sweep_stale_chunks(folder)
            self._swept = True
        for i, chunk in enumerate(weight_chunks(weights, chunk_bytes)):
            if not calls.live:  # every server failed: iterate on (the gathers), write nothing
                continue
            path = os.path.join(folder, f"sgrpo-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}.safetensors")
            save_file({name: value.detach().cpu().contiguous() for name, value in chunk}, path)
            try:
                calls.post("/update_weights", {"update_info": {"path": path}})
            finally:
                os.unlink(path)


def default_chunk_folder() -> str:
    """``CPUTransport``'s folder by default: ``/dev/shm`` (memory, this machine's own) where it exists, else the
    temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


#: a chunk file's name: the writing process's PID, a random tag, the chunk's index
CHUNK_FILE = re.compile(r"sgrpo-weights-(\d+)-[0-9a-f]{8}-\d+\.safetensors")
#: seconds after which a chunk whose writer is gone counts as left behind (a push's chunk lives for seconds)
STALE_AFTER_S = 600.0


def sweep_stale_chunks(folder: str) -> list[str]:
    """Delete the chunk files in ``folder`` whose writing process no longer runs and that are older than
    ``STALE_AFTER_S``, and return their paths: a trainer killed mid-push (``kill -9``, the OOM killer, ``hard_exit``'s
    ``os._exit`` after another process's error) runs no ``finally``, and each left a chunk of up to
    ``weight_chunk_mib`` in ``/dev/shm``, memory, until a reboot. For a folder of this machine only: on a shared one
    another machine's PIDs are not this one's; the age spares the live chunk of a container that shares
    ``/dev/shm`` but not its PIDs with this one (``docker --ipc=host``)."""
    removed, now = [], time.time()
    for name in os.listdir(folder):
        match = CHUNK_FILE.fullmatch(name)
        if match is None or running(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime < STALE_AFTER_S:
                continue
            os.unlink(path)
        except OSError:  # another trainer swept it first, or it is not ours to delete
            continue
        removed.append(path)
    if removed:
        log.info("deleted %d weight chunk file(s) that killed trainers left in %s", len(removed), folder)
    return removed


class NCCLTransport(WeightTransport):
    """vLLM's NCCL backend: rank 0's GPU broadcasts every tensor to the servers' GPUs (separate GPUs, any node).

    Written against vLLM 0.32's trainer engine (``NCCLTrainerWeightTransferEngine``), not yet run: sgrpo's tests
    have no GPU with vLLM. Rank 0 opens the rendezvous at ``master_address:master_port``; each server's workers join
    at their rank offset (one server after another, in ``urls`` order). A restarted server cannot re-join the
    group: ``VLLMServerRollout`` raises instead of pushing (an NCCL broadcast to a missing peer would hang). For the
    same reason a server that fails before the broadcast stops the push on every server (they stay paused in the
    update: restart them). NCCL's collectives have no timeout of sgrpo's: a server that dies mid-broadcast may hang
    rank 0.

    Args:
        master_address: Address of rank 0 as the servers reach it (null: ``MASTER_ADDR``, else 127.0.0.1).
        master_port: A free port on rank 0 for the NCCL rendezvous.
        packed: Broadcast in packed buffers (vLLM's default) instead of one tensor at a time.
    """

    backend = "nccl"
    drives_update = True
    rejoins = False

    def __init__(self, master_address: str | None = None, master_port: int = 29551, packed: bool = True) -> None:
        self.master_address, self.master_port, self.packed = master_address, master_port, packed
        self._engine = None
        self._source: _Source | None = None
        self._client: _FanOutClient | None = None

    def connect(self, pool: ServerPool, weights: Callable[[], Weights], sender: bool) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        sizes = each_server(pool, lambda url: int(pool.get(url, "/get_world_size")["world_size"])) if sender else []
        self._source = _Source(weights)
        info = NCCLTrainerInitInfo(
            master_address=self.master_address or os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=self.master_port, world_size=1 + sum(sizes), packed=self.packed, rank=0 if sender else 1,
        )  # fmt: skip
        self._client = _FanOutClient(pool, sizes)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=self._client, source=self._source)

    def send(self, calls: PushCalls, weights: Weights, chunk_bytes: int, sender: bool) -> None:
        if self._engine is None or self._source is None or self._client is None:
            raise RuntimeError("NCCLTransport.send before connect")
        self._client.calls = calls
        self._source.next = weights
        self._engine.send_weights()  # calls start/update/finish itself (drives_update)


class _Source:
    """vLLM's ``WeightSource`` over sgrpo's weight iterator: metadata from one first pass (a collective, once)."""

    def __init__(self, weights: Callable[[], Weights]) -> None:
        self.make, self.next, self._meta = weights, None, None

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        if self._meta is None:
            self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.make()]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        weights, self.next = (self.next if self.next is not None else self.make()), None
        yield from weights


class _FanOutClient:
    """vLLM's weight-sync client protocol over several servers: each call on every server; the NCCL init gets each
    server's rank offset (trainer rank 0, then the servers' workers in ``urls`` order). A push's calls go through
    its ``PushCalls``; a server that fails raises at once (the broadcast needs every server of the group)."""

    def __init__(self, pool: ServerPool, world_sizes: list[int]) -> None:
        self.pool, self.offsets = pool, [1 + sum(world_sizes[:i]) for i in range(len(world_sizes))]
        self.calls = PushCalls(pool)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets = dict(zip(self.pool.urls, self.offsets))
        each_server(self.pool, lambda url: self.pool.post(
            url, "/init_weight_transfer_engine", {"init_info": dict(init_info, rank_offset=offsets[url])}))  # fmt: skip

    def start_weight_update(self) -> None:
        self.calls.start()
        self.calls.raise_failure()

    def update_weights(self, update_info: Any) -> None:
        self.calls.post("/update_weights", {"update_info": update_info})
        self.calls.raise_failure()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.post("/finish_weight_update", {})  # the version: push's /update_weight_version
        self.calls.raise_failure()


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype: {name!r} is not a torch dtype")
    return value
