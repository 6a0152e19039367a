"""One update of the fixed batch with 2 DDP processes on CPU (gloo): the ``ddp_grads`` job of tests/sharded_worker.py,
run in test_sharded.py's 2-process launch (checked there against test_policy_gradients' single-process gradient).

Micro-batches of 2 rows, so each process runs several backwards per optimiser step (4 on one, 2 plus 2
dummy passes on the other); a DDP communication hook counts the gradient all-reduce rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from estimators import DrGRPO
from tests.engine_helpers import EXAMPLES, fixed_batch, run_steps
from tests.test_policy_gradients import MAX_NEW, G, make_policy, surrogate

#: metrics over the loss tokens of every process (each process's own means, averaged, weighed them unequally)
TOKEN_METRICS = ("train/entropy", "train/update/rows_skipped")


class Recorder:
    rows: list[int] = []
    allreduce_rounds = 0  # backwards whose gradients were all-reduced (one round ends at the last bucket)


def counting_allreduce(state, bucket):
    Recorder.allreduce_rounds += int(bucket.is_last())
    return allreduce_hook(state, bucket)


class CountAllReduces(Callback):
    """Registers the counting hook on the DDP wrapper (Lightning registers ``ddp_comm_hook`` on CUDA only)."""

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.model.register_comm_hook(None, counting_allreduce)


def run(model_dir: str, aggregation: str, out: Path, balance: str | None = None) -> None:
    """One update with ``aggregation`` (and ``model.balance_batch``): the gradient to
    ``out/grads_<aggregation>[_<balance>].pt``, counts and the balance metrics beside it."""
    Recorder.rows, Recorder.allreduce_rounds = [], 0
    batch = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    policy = make_policy(model_dir, batch, DrGRPO(), loss=surrogate(aggregation), micro_batch_size=2,
                         balance_batch=balance)  # fmt: skip
    generate = policy.rollout.generate

    def counting(*args, **kwargs):
        result = generate(*args, **kwargs)
        Recorder.rows.append(result.input_ids.shape[0])
        return result

    policy.rollout.generate = counting
    trainer = run_steps(policy, accelerator="cpu", devices=2, strategy="ddp", callbacks=[CountAllReduces()])
    counts = torch.tensor([float(Recorder.rows[0]), float(Recorder.allreduce_rounds)])
    gathered = [torch.zeros(2) for _ in range(2)]
    torch.distributed.all_gather(gathered, counts)
    name = aggregation + (f"_{balance}" if balance else "")
    if trainer.is_global_zero:
        torch.save(policy.captured[0], out / f"grads_{name}.pt")
        info = {
            **{k: float(v) for k, v in trainer.callback_metrics.items() if k in TOKEN_METRICS or "imbalance" in k},
            "world_size": trainer.world_size,
            "rows_per_rank": [int(c[0]) for c in gathered],
            "allreduce_rounds_per_rank": [int(c[1]) for c in gathered],
        }
        (out / f"grads_{name}.json").write_text(json.dumps(info))
