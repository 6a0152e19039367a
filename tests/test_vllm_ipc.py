"""``IPCTransport`` (vLLM's ``ipc`` backend) on CPU: what can be checked without a GPU.

Main suite: the refusal before the model loads (no CUDA, a server on another machine), the servers sgrpo starts
getting the backend and its environment, the JSON form of an update. ``vllm``-marked (``make test-vllm``): a push
through vLLM 0.32's own trainer engine (``IPCTrainerWeightTransferEngine``) to stand-in servers that hand every RL
call to vLLM's own receiving engine (``IPCWeightTransferEngine``: it parses the init and update payloads, maps the
buffer, unpacks and loads). Only the CUDA calls are replaced (``FakeCuda``): a "device buffer" is a file in shared
memory and its "IPC handle" names the file, so the server reads the trainer's buffer at the moment it answers, as
it would by CUDA IPC. Not checked here: real CUDA IPC, real servers on a GPU (docs/servers.md says so).
"""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgrpo.checks import ConfigError
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import IPCTransport, VLLMServerRollout, VLLMServers
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_http import ServerError
from sgrpo.rollout.vllm_ipc import http_update_info, on_this_machine
from sgrpo.rollout.weightsync import engine_weights
from sgrpo.run.preflight import check_rollout_servers
from sgrpo.types import Example
from tests.fake_vllm_server import FakeServer

EXAMPLES = [Example(prompt="s:31=", answer="13")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- main suite
def test_ipc_is_refused_before_the_model_loads_without_cuda_or_with_a_server_elsewhere(monkeypatch):
    engine = VLLMServerRollout(urls=[f"http://127.0.0.1:{free_port()}"], transport=IPCTransport())
    monkeypatch.setattr("sgrpo.rollout.vllm_ipc.torch.cuda.is_available", lambda: False)
    policy = SimpleNamespace(rollout=engine, val_rollout=None)
    with pytest.raises(ConfigError, match=r"^model.rollout: transport: IPCTransport needs CUDA .*use sgrpo.rollout"):
        check_rollout_servers(policy)  # before the health check (that server is down too)
    monkeypatch.setattr("sgrpo.rollout.vllm_ipc.torch.cuda.is_available", lambda: True)
    policy.rollout = VLLMServerRollout(urls=["http://192.0.2.1:8000"], transport=IPCTransport())  # TEST-NET-1
    with pytest.raises(ConfigError, match="IPCTransport needs the servers on this machine's GPUs; http://192.0.2.1"):
        check_rollout_servers(policy)
    assert IPCTransport().preflight([f"http://localhost:{free_port()}", "http://127.0.0.1:1"]) is None
    assert IPCTransport().preflight(None) is None  # servers sgrpo starts: on this machine
    assert on_this_machine(socket.gethostname()) and not on_this_machine("no-such-host.invalid")


def test_the_servers_sgrpo_starts_get_the_ipc_backend_and_its_environment(tmp_path):
    record = tmp_path / "python"  # a "python" that writes its arguments and environment, then exits
    record.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nenv > {tmp_path}/env\nexit 3\n')
    record.chmod(0o755)
    transport = IPCTransport()
    launch = VLLMServers(ports=[free_port()], python=str(record), startup_timeout=20, log_dir=str(tmp_path),
                         devices=["0"], env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "OTHER": "x"})  # fmt: skip
    with pytest.raises(ServerError, match="exited with code 3"):
        launch.start("MODEL", "bfloat16", None, transport.server_args(), transport.server_env())
    assert '--weight-transfer-config {"backend": "ipc"}' in (tmp_path / "args").read_text()
    env = (tmp_path / "env").read_text().splitlines()
    assert {"VLLM_ALLOW_INSECURE_SERIALIZATION=1", "CUDA_VISIBLE_DEVICES=0", "OTHER=x"} <= set(env)


def test_an_update_travels_as_json_with_its_handles_pickled():
    handles = {"GPU-1": (bytes(range(8)), 4096, 0, b"\x00handle", 7, 0, 3, True)}
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]], "ipc_handles": handles,
              "tensor_sizes": [12]}  # fmt: skip
    sent = json.loads(json.dumps(http_update_info(update)))
    assert "ipc_handles" not in sent and sent["tensor_sizes"] == [12] and sent["shapes"] == [[2, 3]]
    assert pickle.loads(base64.b64decode(sent["ipc_handles_pickled"])) == handles


# ---------------------------------------------------------------------------------------------- vLLM's engines
class FakeCuda:
    """``torch`` as vLLM's IPC modules see it, on a CPU "GPU" named ``uuid``: ``empty(..., device="cuda")`` maps a
    file of ``folder`` (shared memory), ``reduce_tensor`` returns rebuild args naming that file (index 6: the
    device, which the receiver overwrites, as with CUDA's), ``rebuild`` maps it again. The rest is torch's."""

    def __init__(self, uuid: str, folder: Path) -> None:
        self.uuid, self.folder, self.files = uuid, folder, {}
        self.cuda = SimpleNamespace(
            get_device_properties=lambda index: SimpleNamespace(uuid=self.uuid),
            current_stream=lambda: SimpleNamespace(synchronize=lambda: None),
            synchronize=lambda: None, ipc_collect=lambda: None, is_available=lambda: True,
        )  # fmt: skip
        self.accelerator = SimpleNamespace(current_device_index=lambda: 0, synchronize=lambda: None)

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, size: int, dtype=None, device=None):
        assert device == "cuda" and dtype == torch.uint8
        path = self.folder / f"{self.uuid}-{len(self.files)}.buffer"
        buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.files[buffer.data_ptr()] = str(path)
        return buffer

    def reduce_tensor(self, tensor):
        return FakeCuda.rebuild, ("file", self.files[tensor.data_ptr()], tensor.numel(), 0, 0, 0, 0, False)

    @staticmethod
    def rebuild(kind, path, size, *rest):
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def fake_cuda(monkeypatch, uuid: str, folder: Path) -> FakeCuda:
    """vLLM's IPC engines (both sides) and sgrpo's transport on ``FakeCuda``; the CUDA calls only."""
    from vllm.distributed.weight_transfer import base, ipc_engine, packed_tensor
    from vllm.model_executor.model_loader import reload

    fake = FakeCuda(uuid, folder)
    for module in (base, ipc_engine, packed_tensor):
        monkeypatch.setattr(module, "torch", fake)
    monkeypatch.setattr(packed_tensor, "reduce_tensor", fake.reduce_tensor)
    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", FakeCuda.rebuild)
    monkeypatch.setattr("sgrpo.rollout.vllm_ipc.torch", fake)
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: None)  # a real model's reload
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: None)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the servers' environment (server_env)
    return fake


class Loaded(torch.nn.Module):
    """The server's model: what vLLM's engine loads into it."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        self.weights.update((name, tensor.clone()) for name, tensor in weights)


class IPCServer(FakeServer):
    """A stand-in server whose RL calls go to vLLM's own receiving engine, as a vLLM worker's do (with the
    worker's check that updates come between start and finish). ``hang_at``: the update call that hangs."""

    def __init__(self, gpu: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gpu, self.hang_at, self.updates = gpu, None, []
        self.restart()

    def restart(self) -> None:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        self.model = Loaded()
        config = SimpleNamespace(parallel_config=None, model_config=None)
        self.engine = IPCWeightTransferEngine(WeightTransferConfig(backend="ipc"), config,
                                              torch.device("cuda", 0), self.model)  # fmt: skip
        self.version, self.active, self.paused = "default", False, False

    def body(self, path, payload):
        engine = self.engine
        self.check_update(path)  # vLLM's worker refuses calls out of order before its engine sees them
        if path == "/init_weight_transfer_engine":
            engine.init_transfer_engine(engine.parse_init_info(payload["init_info"]))
        elif path == "/start_weight_update":
            engine.start_weight_update()
        elif path == "/update_weights":
            self.updates.append(payload["update_info"])
            if len(self.updates) == self.hang_at:
                time.sleep(2)
            with patched_gpu(self.gpu):
                engine.update_weights(payload["update_info"])
        elif path == "/finish_weight_update":
            engine.finish_weight_update()
        return super().body(path, payload)  # the update's state, the version


_gpu = threading.local()  # the GPU a thread sees: the trainer's, or a server's inside `patched_gpu`


@contextlib.contextmanager
def patched_gpu(uuid: str):
    _gpu.uuid = uuid
    try:
        yield
    finally:
        _gpu.uuid = None


@pytest.fixture
def ipc(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    fake = fake_cuda(monkeypatch, "GPU-trainer", tmp_path)
    # the trainer's thread sees the trainer's GPU; a server thread inside `patched_gpu` its own
    fake.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=getattr(_gpu, "uuid", None) or fake.uuid)
    made: list[IPCServer] = []

    def server(gpu: str = "GPU-trainer", **kwargs) -> IPCServer:
        made.append(IPCServer(gpu, **kwargs))
        return made[-1]

    yield server
    for s in made:
        s.stop()


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_llama(tokenizer), tokenizer


def rl_calls(server: FakeServer) -> list[str]:
    skip = ("/health", "/inference/v1/generate", "/weight_info")
    return [p.split("?")[0] for p, _ in server.calls if p.split("?")[0] not in skip]


@pytest.mark.vllm
def test_a_push_is_what_vllm_s_ipc_receiver_parses_and_loads_chunk_by_chunk(ipc, tiny):
    model, tokenizer = tiny
    a, b = ipc(), ipc()
    engine = VLLMServerRollout(urls=[a.url, b.url], max_new_tokens=4, dtype="bfloat16", weight_chunk_mib=0.02,
                               transport=IPCTransport())  # fmt: skip
    engine.generate(model, tokenizer, EXAMPLES, group_size=1)
    expected = dict(engine_weights(model, torch.bfloat16))
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert largest > 0.02 * 2**20  # one tensor is larger than a chunk: it goes alone, in a buffer of its size
    for server in (a, b):
        assert server.engine.packed and server.version == engine._pushed
        assert server.model.weights.keys() == expected.keys()
        assert all(torch.equal(server.model.weights[n], t) and t.dtype == torch.bfloat16 for n, t in expected.items())
        sizes = [sum(u["tensor_sizes"]) for u in server.updates]
        assert len(sizes) > 5 and all(s <= max(0.02 * 2**20, largest) for s in sizes)
        assert sum(sizes) == sum(t.numel() * 2 for t in expected.values())
        assert all(set(pickle.loads(base64.b64decode(u["ipc_handles_pickled"]))) == {"GPU-trainer"}
                   for u in server.updates)  # fmt: skip
        calls = rl_calls(server)
        k = len(server.updates)
        init = "/init_weight_transfer_engine"  # at connect (vLLM's trainer_init), then before every push
        assert calls == [init, "/pause", init, "/start_weight_update", *["/update_weights"] * k,
                         "/finish_weight_update", "/update_weight_version", "/resume"]  # fmt: skip
    # a restarted server (vLLM's engine anew: packed=False) gets the init again, and every weight
    a.restart()
    a.updates.clear()
    engine.generate(model, tokenizer, EXAMPLES, group_size=1)
    assert a.engine.packed and a.model.weights.keys() == expected.keys() and a.version == engine._pushed
    # the servers need VLLM_ALLOW_INSECURE_SERIALIZATION=1 (sgrpo's servers get it): vLLM refuses the handles else
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
        with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
            IPCWeightTransferUpdateInfo(**a.updates[0])


@pytest.mark.vllm
def test_a_server_that_hangs_mid_push_is_named_after_the_others_got_every_weight(ipc, tiny):
    model, tokenizer = tiny
    good, hung = ipc(), ipc()
    engine = VLLMServerRollout(urls=[good.url, hung.url], max_new_tokens=4, dtype="bfloat16", weight_chunk_mib=0.02,
                               sync_timeout=0.5, transport=IPCTransport())  # fmt: skip
    hung.hang_at = 2
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"{hung.url}/update_weights: no answer within 0.5 s"):
        engine.generate(model, tokenizer, EXAMPLES, group_size=1)
    assert time.monotonic() - start < 5 and engine._pushed is None
    expected = dict(engine_weights(model, torch.bfloat16))
    assert good.model.weights.keys() == expected.keys() and not good.active  # finished: ready for the next push
    assert good.version == f"sgrpo-{engine._tag}-1" and not good.paused  # the push's version, resumed
    assert rl_calls(hung)[-1] == "/update_weights" and len(hung.updates) == 2  # left out after it hung
    time.sleep(2)  # the hung call ends: its update stays active (a real worker's would too), the server paused
    assert hung.active and hung.paused
    bump_weights_version(model)
    engine.generate(model, tokenizer, EXAMPLES, group_size=1)  # the next push carries on in that update
    assert good.version == hung.version == engine._pushed and hung.model.weights.keys() == expected.keys()
    assert not hung.active and not hung.paused

