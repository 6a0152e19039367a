"""The DDP jobs of tests/test_sharded.py's joined 2-process launch (split from tests/sharded_worker.py) and their
checks: one update per loss aggregation against the single-process gradient, the same with ``model.balance_batch``
(rows, groups), a balanced update whose process 1 raises in the exchange, a step non-finite on one process only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from estimators import GRPO, DrGRPO
from sgrpo.train.loss import AGGREGATIONS
from tests.engine_helpers import EXAMPLES, fixed_batch, run_steps
from tests.test_policy_gradients import MAX_NEW, G, flat, make_policy, rel_err, surrogate

#: the aggregations whose denominators are all-reduced: moving rows between processes changes float rounding only
GLOBAL = ("token_mean", "seq_mean_token_mean", "seq_sum_const")


def ddp_jobs(model_dir: str, out: Path) -> list[list[str]]:
    """The jobs (``sharded_worker.py`` modes), their results under ``out``."""
    return [
        ["ddp_grads", model_dir, str(out / "ddp"), *AGGREGATIONS],
        ["ddp_balanced", model_dir, str(out / "ddp"), *GLOBAL],
        ["balance_failure", model_dir, str(out / "balance_failure")],
        ["nonfinite", model_dir, str(out / "nonfinite")],
    ]


def check_ddp_jobs(single: dict[str, torch.Tensor], out: Path) -> None:
    """The checks below (``ddp_grads``' own is test_sharded.py's ``check_two_ddp_processes_give_the_single_process_
    gradient``), ``single`` the single-process gradients (``single_process_gradients``)."""
    check_balanced_processes_give_the_unbalanced_gradient(single, out / "ddp")
    check_a_process_raising_in_the_exchange_ends_both(out / "balance_failure")
    check_a_step_non_finite_on_one_process_is_skipped_on_every_process(out / "nonfinite")


# ------------------------------------------------------------------------------------------- the processes' side
def ddp_grads(model_dir: str, out: str, *aggregations: str) -> None:
    """One update of the fixed batch per aggregation with 2 DDP processes (tests/ddp_grad_worker.py), to OUT."""
    from tests.ddp_grad_worker import run

    Path(out).mkdir(parents=True, exist_ok=True)
    for aggregation in aggregations:
        run(model_dir, aggregation, Path(out))


def ddp_balanced(model_dir: str, out: str, *aggregations: str) -> None:
    """One DDP update per aggregation and ``model.balance_batch`` mode ("rows", "groups"), to OUT."""
    from tests.ddp_grad_worker import run

    Path(out).mkdir(parents=True, exist_ok=True)
    for aggregation in aggregations:
        for balance in ("rows", "groups"):
            run(model_dir, aggregation, Path(out), balance)


def balance_failure(model_dir: str, out: str) -> None:
    """A DDP update with ``model.balance_batch: rows`` whose process 1 raises preparing its rows for the exchange:
    both processes must raise (process 0 waited in the all-gather for ever before); each one's error to
    OUT/failure.RANK.json."""
    from sgrpo.train.exchange import BalancedRows

    rank, prepare = torch.distributed.get_rank(), BalancedRows._exchanged_payload

    def failing(self, *args):
        if rank == 1:
            raise MemoryError("process 1 ran out of memory")
        return prepare(self, *args)

    batch = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    policy = make_policy(model_dir, batch, GRPO(), balance_batch="rows")
    BalancedRows._exchanged_payload, error = failing, None
    try:
        run_steps(policy, accelerator="cpu", devices=2, strategy="ddp")
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    finally:
        BalancedRows._exchanged_payload = prepare
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"failure.{rank}.json").write_text(json.dumps(error))


def nonfinite(model_dir: str, out: str) -> None:
    """Two DDP steps whose first has a NaN gradient on process 1 only (after the all-reduce: as a process-local
    overflow would): every process must skip it, or their weights part. Each process's weight checksum and
    skip count to OUT/nonfinite.json."""
    from tests.test_optimiser_steps import poisoned_policy

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    batch = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    policy = poisoned_policy(model_dir, batch, poison=(0,) if rank == 1 else ())
    trainer = run_steps(policy, steps=2, accelerator="cpu", devices=2, strategy="ddp")
    mine = torch.tensor([sum(float(p.detach().double().sum()) for p in policy.model.parameters()),
                         float(policy.divergence_watch.skipped)], dtype=torch.float64)  # fmt: skip
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    torch.distributed.all_gather(gathered, mine)
    if trainer.is_global_zero:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "nonfinite.json").write_text(json.dumps([g.tolist() for g in gathered]))


# ------------------------------------------------------------------------------------------- the test's side
def single_process_gradients(model_dir: str) -> dict[str, torch.Tensor]:
    """The fixed batch's gradient in one process, flattened, per loss aggregation (what the DDP jobs are checked
    against: computed once for all of them), and under "<aggregation>/<metric>" the run's ``TOKEN_METRICS``."""
    from tests.ddp_grad_worker import TOKEN_METRICS

    batch, single = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW), {}
    for aggregation in AGGREGATIONS:
        policy = make_policy(model_dir, batch, DrGRPO(), loss=surrogate(aggregation))
        metrics = run_steps(policy).callback_metrics
        single[aggregation] = flat(policy.captured[0])
        single |= {f"{aggregation}/{key}": metrics[key].clone() for key in TOKEN_METRICS}
    return single


def check_balanced_processes_give_the_unbalanced_gradient(single: dict[str, torch.Tensor], out: Path) -> None:
    """``model.balance_batch`` "rows" and "groups" over 2 DDP processes with different data: the gradient of the
    unbalanced run (which is the single-process one) within 1e-6 for every global aggregation, the rows
    having moved ("rows": the processes' real-token imbalance fell)."""
    for aggregation in GLOBAL:
        unbalanced = flat(torch.load(out / f"grads_{aggregation}.pt"))
        for mode in ("rows", "groups"):
            info = json.loads((out / f"grads_{aggregation}_{mode}.json").read_text())
            balanced = flat(torch.load(out / f"grads_{aggregation}_{mode}.pt"))
            assert rel_err(balanced, unbalanced) < 1e-6, mode
            assert rel_err(balanced, single[aggregation]) < 1e-6, mode
            before, after = info["train/update/token_imbalance_before"], info["train/update/token_imbalance_after"]
            # rows: even to a row; groups: 4 groups of which one costs nothing (constant): at best as even as before
            assert after < before if mode == "rows" else after <= before, (aggregation, mode, info)
            assert info["allreduce_rounds_per_rank"] == [1, 1], (aggregation, mode)


def check_a_process_raising_in_the_exchange_ends_both(out: Path) -> None:
    """Process 1 raised preparing its rows: it raised its own error, process 0 one naming the cause, and neither
    waited (a hang fails the launch at its timeout)."""
    errors = [json.loads((out / f"failure.{rank}.json").read_text()) for rank in (0, 1)]
    assert errors[1] == "MemoryError: process 1 ran out of memory", errors
    assert errors[0] == ("RuntimeError: model.balance_batch: another process failed preparing its rows for the "
                         "exchange"), errors  # fmt: skip


def check_a_step_non_finite_on_one_process_is_skipped_on_every_process(out: Path) -> None:
    """A NaN gradient on process 1 only: without the skip flag OR-ed over processes, process 0 applied the step
    and process 1 skipped it, and their weights parted (measured: checksums 304.99 and 304.48)."""
    (weights_0, skipped_0), (weights_1, skipped_1) = json.loads((out / "nonfinite.json").read_text())
    assert skipped_0 == skipped_1 == 1.0
    assert weights_0 == weights_1
