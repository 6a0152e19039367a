"""Run by tests/test_vllm_server.py on 2 processes (torchrun, gloo): an FSDP2-sharded trainer (``shard_model``, what
``ModelParallelStrategy`` gets in ``GRPOPolicy.configure_model``) rolls out from a vLLM server through rank 0.

vllm_server_worker.py URL MODEL_DIR OUT   each process: its own prompts, greedy, after a push of changed weights;
                                          results (token ids, log-probs, pushes, the RL calls it made) to OUT/rankR.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sgrpo.model.loading import shard_model  # noqa: E402
from sgrpo.rollout.engine import bump_weights_version  # noqa: E402
from sgrpo.rollout.vllm_server import VLLMServerRollout  # noqa: E402
from tests.vllm_server_helpers import EXAMPLES, perturbed  # noqa: E402


def main(url: str, model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=11)  # the same on both processes
    shard_model(model, dist.device_mesh.init_device_mesh("cpu", (2,)))
    bump_weights_version(model)
    engine = VLLMServerRollout(urls=[url], max_new_tokens=6, dtype="float32", max_model_len=64, sync_timeout=60)
    calls: list[str] = []
    post = engine.pool.post
    engine.pool.post = lambda u, path, *a, **k: calls.append(path) or post(u, path, *a, **k)
    examples = EXAMPLES[rank::2]  # different prompts per process
    batch = engine.generate(model, tokenizer, examples, group_size=2, greedy=True)
    again = engine.generate(model, tokenizer, examples, group_size=2, greedy=True)  # unchanged: no second push
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "ids": batch.input_ids.tolist(), "logprobs": batch.logprobs.tolist(), "mask": batch.completion_mask.tolist(),
        "again": again.input_ids.tolist(), "syncs": engine.syncs, "rl_calls": calls,
        "versions": engine.last_weight_versions,
    }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
