"""Same-GPU weight push: vLLM's ``ipc`` backend, the trainer's GPU memory handed to servers on its GPUs by CUDA IPC.

vLLM 0.32's trainer engine (``IPCTrainerWeightTransferEngine``, packed) does the transfer: it copies the policy's
weights (in the servers' dtype, one chunk of ``weight_chunk_mib`` at a time) into one staging buffer on the
trainer's GPU, exported once for CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``); each
``/update_weights`` carries the chunk's names, dtypes, shapes, byte sizes and the buffer's handle (pickled and
base64-encoded, ``ipc_handles_pickled``: the server needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). The server maps
the buffer, copies the chunk out and loads it before it answers; only then is the buffer refilled, so it holds
every chunk until the servers acknowledged it. Only a handle crosses HTTP, never a weight.

Every trainer process takes part (vLLM all-gathers each process's handle, keyed by its GPU's UUID): a server on
any training GPU reads the copy on its own GPU, so one server per training GPU works as well as one on rank 0's.
Written against vLLM 0.32's API; not yet run (no GPU with vLLM at hand). What its CPU tests check:
``tests/test_vllm_ipc.py``.
"""

from __future__ import annotations

import math
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch

from sgrpo.rollout.vllm_http import ServerPool
from sgrpo.rollout.vllm_push import PushCalls, Weights, WeightTransport, _Source

#: the servers' environment: vLLM unpickles the handles only with it
SERVER_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


class IPCTransport(WeightTransport):
    """vLLM's ``ipc`` backend: trainer and servers on the same GPUs of one machine (CUDA IPC handles, no copy
    through the host). Servers get ``--weight-transfer-config '{"backend": "ipc"}'`` and
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the ones sgrpo starts get both), and must leave the trainer room on
    the GPU (``--gpu-memory-utilization``: docs/servers.md, "One GPU").

    Written against vLLM 0.32's trainer engine, not yet run. A server that fails mid-push is left out of the rest of
    the push, which every trainer process finishes in step (vLLM's handle all-gather and per-chunk barriers); the
    other servers get the new version and ``/resume``, then rank 0 raises its error naming it: no process waits in
    a barrier for a rank 0 that gave up. The staging buffer is ``weight_chunk_mib`` or the largest tensor if larger
    (a larger tensor goes alone, as with the other transports).
    """

    backend = "ipc"
    drives_update = True

    def __init__(self) -> None:
        self._engine = None
        self._source: _Source | None = None
        self._client: _IPCClient | None = None

    def server_env(self) -> dict[str, str]:
        return dict(SERVER_ENV)

    def preflight(self, urls: list[str] | None) -> str | None:
        """Why the transfer cannot work here (no CUDA in the trainer, a server on another machine), or None."""
        if not torch.cuda.is_available():
            return ("transport: IPCTransport needs CUDA (trainer and servers on this machine's GPUs) and torch sees "
                    "none here; use sgrpo.rollout.CPUTransport (CPU servers) or NCCLTransport")  # fmt: skip
        for url in urls or []:
            host = urllib.parse.urlsplit(url).hostname or ""
            if not on_this_machine(host):
                return (f"transport: IPCTransport needs the servers on this machine's GPUs; {url} is not on this "
                        "machine (use NCCLTransport for servers elsewhere)")  # fmt: skip
        return None

    def connect(self, pool: ServerPool, weights: Callable[[], Weights], sender: bool) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        problem = self.preflight(None)
        if problem:
            raise RuntimeError(f"model.rollout: {problem}")
        self._source, self._client = _Source(weights), _IPCClient(pool)
        self._engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0 if sender else 1, packed=True), client=self._client, source=self._source
        )

    def send(self, calls: PushCalls, weights: Weights, chunk_bytes: int, sender: bool) -> None:
        if self._engine is None or self._source is None or self._client is None:
            raise RuntimeError("IPCTransport.send before connect")
        largest = max(math.prod(m.shape) * m.dtype.itemsize for m in self._source.metadata())  # one pass, once
        self._engine.packed_buffer_size_bytes = max(chunk_bytes, largest)
        self._client.calls = calls
        if sender:  # every push: vLLM's init only records `packed`, which a restarted server has lost
            self._client.init_weight_transfer_engine({"packed": True})
        self._source.next = weights
        self._engine.send_weights()  # start, one update per chunk, finish (drives_update); push raises a failure


def on_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine (one of its addresses can be bound)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


class _IPCClient:
    """vLLM's weight-sync client protocol (``VLLMWeightSyncClient``) over the servers of one push (its
    ``PushCalls``), called by the sender alone. The update's handles travel pickled (``ipc_handles_pickled``, as
    vLLM's HTTP client sends them). A call that fails on a server leaves that server out of the rest of the push,
    which every process then completes in step; ``push`` raises the failure after finishing the others."""

    def __init__(self, pool: ServerPool) -> None:
        self.calls = PushCalls(pool)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.calls.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.post("/update_weights", {"update_info": http_update_info(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.post("/finish_weight_update", {})  # the version: push's /update_weight_version


def http_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """The update as JSON: the handles (tuples of bytes and ints) pickled and base64-encoded into
    ``ipc_handles_pickled``, the field vLLM's ``IPCWeightTransferUpdateInfo`` unpickles."""
    import base64
    import pickle

    info = {key: value for key, value in update_info.items() if key != "ipc_handles"}
    info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return info
