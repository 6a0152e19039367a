"""What the real-server tests share (``tests/test_vllm_server.py``, ``tests/test_vllm_server_episodes.py`` and the
2-process worker ``tests/vllm_server_worker.py``): the prompts, the server's arguments, weights that differ from the
served ones, the checks against HF decoding, and a transport that kills the server mid-push. Imports no vLLM."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from sgrpo.model.logprobs import completion_logprobs
from sgrpo.rollout import HFRollout
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_push import CPUTransport
from sgrpo.types import Example

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = [Example(prompt="s:3142=", answer="1234"), Example(prompt="s:91=", answer="19"),
            Example(prompt="s:50724=", answer="02457"), Example(prompt="s:8=", answer="8")]  # fmt: skip
SERVER_ARGS = ["--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 * 2**20), "--enforce-eager"]


#: a process group's variables: an in-process vLLM engine of an earlier test exports them (RANK=0, WORLD_SIZE=1,
#: MASTER_PORT=...), and a 2-process fit that inherits them waits for a process group that is not its own
DISTRIBUTED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT")  # fmt: skip


def child_environment() -> dict[str, str]:
    """The environment a test's subprocess starts with: this one's, less any process group's, one thread."""
    return {k: v for k, v in os.environ.items() if k not in DISTRIBUTED} | {"OMP_NUM_THREADS": "1"}


def perturbed(model, seed: int):
    """``model`` with every parameter moved by N(0, 0.3^2) noise drawn from ``seed``: the trainer's changed weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy(model_dir: str, seed: int):
    model = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed)
    bump_weights_version(model)
    return model


def assert_matches_hf(batch, model, tokenizer, examples, group_size: int) -> float:
    """Token for token HF's greedy completions; the log-probs within 1e-4 of the model's. The largest gap."""
    hf = HFRollout(max_new_tokens=6).generate(model, tokenizer, examples, group_size, greedy=True)
    assert batch.input_ids.tolist() == hf.input_ids.tolist()
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    gap = (logp - batch.logprobs)[batch.completion_mask].abs().max().item()
    assert gap < 1e-4
    return gap


def in_process_fit(root: Path, url: str, model_dir: str, *extra: str, steps: int = 3) -> dict:
    """A 1-process ``sgrpo.fit`` of configs/tiny.yaml sampling from the server; its metrics by key."""
    from sgrpo.eval.report import read_run_metrics
    from sgrpo.fit import main

    rollout = {"class_path": "sgrpo.rollout.VLLMServerRollout", "init_args": {
        "urls": [url], "max_new_tokens": 8, "dtype": "float32", "max_model_len": 64}}  # fmt: skip
    main(["--config", str(REPO / "configs" / "tiny.yaml"), f"--model.rollout={json.dumps(rollout)}",
          f"--model.model={model_dir}", f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
          "--model.task.init_args.levels=[1, 2]", "--model.task.init_args.reward=tests.vllm_fakes.Parity",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.val_check_interval=1000", "--model.log_completions_every=1", *extra])  # fmt: skip
    return read_run_metrics(root)


def wait_in_flight(producer, requests: int, within: float = 120.0) -> None:
    """Until ``producer`` has ``requests`` HTTP requests in flight (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while producer._in_flight < requests and time.monotonic() < deadline:
        time.sleep(0.01)


class KillingTransport(CPUTransport):
    """Sends the first chunk, then kills the server (its process group) before the next."""

    def __init__(self, launch: VLLMServers) -> None:
        super().__init__()
        self.launch = launch

    def send(self, pool, weights, chunk_bytes, sender):
        sent = iter(weights)

        def killing():
            yield next(sent)
            for process in self.launch.processes:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            yield from sent

        super().send(pool, killing(), chunk_bytes=1, sender=sender)  # one tensor per chunk
