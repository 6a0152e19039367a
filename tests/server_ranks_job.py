"""A job of tests/test_sharded.py's joined 2-process launch (``sharded_worker.py server_ranks PYTHON URL OUT``,
gloo, no vLLM): what the other process learns when rank 0 fails to start its servers, or fails a push.

``server_ranks``: first ``launch`` with PYTHON as the servers' interpreter (rank 0 starts them), then ``urls=[URL]``
(a server whose RL calls fail), then the same with the model FSDP2-sharded; each process's errors and the seconds
each took to OUT/rankR.json.
``check_server_ranks``: the test's side.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout.vllm_http import ServerError
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.types import Example


def attempt(engine: VLLMServerRollout, model, tokenizer) -> dict:
    start = time.monotonic()
    try:
        engine.generate(model, tokenizer, [Example(prompt="s:4=", answer="4")], group_size=1)
        error = None
    except ServerError as err:
        error = str(err)
    return {"error": error, "seconds": time.monotonic() - start}


def server_ranks(python: str, url: str, out: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tokenizer)
    launch = VLLMServers(ports=[int(url.rsplit(":", 1)[1]) + 1], model="MODEL", python=python, startup_timeout=60,
                         log_dir=out)  # fmt: skip
    results = {"start": attempt(VLLMServerRollout(launch=launch, max_new_tokens=4), model, tokenizer)}
    dist.barrier()
    results["push"] = attempt(VLLMServerRollout(urls=[url], max_new_tokens=4, sync_timeout=5), model, tokenizer)
    from sgrpo.model.loading import shard_model

    shard_model(model, dist.device_mesh.init_device_mesh("cpu", (2,)))  # the push's gathers are now collectives
    results["push_sharded"] = attempt(VLLMServerRollout(urls=[url], max_new_tokens=4, sync_timeout=5), model, tokenizer)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


def prepare_server_ranks(out: Path):
    """The job's arguments (a servers' interpreter that exits at once; a stand-in server, healthy, whose push fails)
    and the server (stop it after the launch)."""
    from tests.fake_vllm_server import FakeServer

    out.mkdir(parents=True, exist_ok=True)
    fails = out / "python"
    fails.write_text("#!/bin/sh\nexit 3\n")
    fails.chmod(0o755)
    server = FakeServer()
    server.fail_on = {"/init_weight_transfer_engine"}
    return ["server_ranks", str(fails), server.url, str(out)], server


def check_server_ranks(out: Path) -> None:
    """Rank 0 alone starts the servers and pushes; when it fails, rank 1 raises its error at once (before: rank 1
    polled /health for the whole startup_timeout, 60 s here)."""
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "stopped while starting" in rank0["start"]["error"]
    assert rank1["start"]["error"].startswith("rank 0: ") and "stopped while starting" in rank1["start"]["error"]
    assert rank1["start"]["seconds"] < 20, rank1  # not the 60 s startup_timeout
    assert "/init_weight_transfer_engine: HTTP 500" in rank0["push"]["error"]
    assert rank1["push"]["error"] == f"rank 0: {rank0['push']['error']}"
    # FSDP2: rank 0's failed connect reached rank 1 before its gathers (before: rank 1 gathered, rank 0 broadcast
    # its error, and both waited for the process group's timeout)
    assert rank1["push_sharded"]["error"] == f"rank 0: {rank0['push_sharded']['error']}", rank1
    assert "/init_weight_transfer_engine: HTTP 500" in rank0["push_sharded"]["error"]
    assert rank1["push_sharded"]["seconds"] < 20, rank1
