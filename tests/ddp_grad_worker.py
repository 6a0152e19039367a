"""Run by test_policy_gradients: one update of the fixed batch with 2 DDP processes on CPU (gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from estimators import DrGRPO
from tests.engine_helpers import EXAMPLES, fixed_batch, run_steps
from tests.test_policy_gradients import MAX_NEW, G, make_policy


class Recorder:
    rows: list[int] = []


def main(model_dir: str, aggregation: str, out: str) -> None:
    batch = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    policy = make_policy(model_dir, batch, DrGRPO(), aggregation=aggregation)
    generate = policy.rollout.generate

    def counting(*args, **kwargs):
        result = generate(*args, **kwargs)
        Recorder.rows.append(result.input_ids.shape[0])
        return result

    policy.rollout.generate = counting
    trainer = run_steps(policy, accelerator="cpu", devices=2, strategy="ddp")
    rows = [torch.zeros(1) + Recorder.rows[0] for _ in range(2)]
    torch.distributed.all_gather(rows, torch.tensor([float(Recorder.rows[0])]))
    if trainer.is_global_zero:
        torch.save(policy.captured[0], out)
        info = {"world_size": trainer.world_size, "rows_per_rank": [int(r.item()) for r in rows]}
        Path(out).with_name("grads.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(*sys.argv[1:4])
