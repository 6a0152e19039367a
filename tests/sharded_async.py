"""Async rollouts over 2 processes in the joined launch of tests/test_sharded.py: the jobs (``async_jobs``) and
their check."""

from __future__ import annotations

from pathlib import Path

import torch

from sgrpo.eval.report import read_run_metrics

SHIPPED = Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model"  # trained: its rewards vary


def async_jobs(out: Path, fused: str) -> list[list[str]]:
    """Async rollouts over 2 processes (the shipped model: its rewards vary, so the weights move): a synchronous DDP
    fit and its staleness-0 async twin, the same under FSDP2 (fused AdamW), and S = 1 DDP fits
    with the producers 5x slower and 5x faster than the trainers."""
    ddp, shipped = "--trainer.strategy=ddp", str(SHIPPED)
    return [
        ["fit", str(out / "sync"), shipped, "3", "", ddp],
        ["async_fit", str(out / "s0"), shipped, "3", "", ddp, "--model.max_staleness=0"],
        ["fit", str(out / "fsdp_sync"), shipped, "3", "", fused],
        ["async_fit", str(out / "fsdp_s0"), shipped, "3", "", fused, "--model.max_staleness=0"],
        ["async_fit", str(out / "slow"), shipped, "4", "slow", ddp, "--model.max_staleness=1"],
        ["async_fit", str(out / "fast"), shipped, "4", "fast", ddp, "--model.max_staleness=1"],
        ["async_estimators", str(out / "estimators"), shipped, "2", *ESTIMATOR_VARIANTS],
    ]


#: the S = 0 twins beyond the default estimator's (SoftmaxGRPO, above); "+dynamic": with dynamic sampling's refills
ESTIMATOR_VARIANTS = ("GRPO", "MaxRL", "DrGRPO", "RLOO+dynamic")  # ~20 s a pair at load average 20


def check_async_rollouts_over_two_processes(out: Path) -> None:
    """Staleness 0 through the producers is the synchronous run bit for bit under DDP and FSDP2 (every logged value
    but timings, the final weights), and under DDP with every other estimator and with dynamic sampling's refills;
    with producers 5x slower or faster, every step trains its 4 groups (2 a process), whole, none staler than
    S = 1."""
    from tests.test_async import check_bounded, same_weights, untimed

    for sync, twin in (("sync", "s0"), ("fsdp_sync", "fsdp_s0")):
        synchronous, stale0 = read_run_metrics(out / sync), read_run_metrics(out / twin)
        assert untimed(stale0) == untimed(synchronous) and len(synchronous["train/loss"]) == 3, twin
        assert [v for _, v in stale0["train/async/staleness_max"]] == [0.0] * 3
        probes = [torch.load(out / run / "probe_logprobs.pt") for run in (sync, twin)]
        assert torch.equal(*probes), twin
    assert same_weights(out / "sync", out / "s0")
    for variant in ESTIMATOR_VARIANTS:  # 2 steps each: step 1 is sampled under the pushed weights of version 1
        runs = out / "estimators" / variant
        synchronous, stale0 = read_run_metrics(runs / "sync"), read_run_metrics(runs / "s0")
        assert untimed(stale0) == untimed(synchronous) and len(synchronous["train/loss"]) == 2, variant
        assert same_weights(runs / "sync", runs / "s0"), variant
        if variant.endswith("+dynamic"):  # refills ran (on both processes, as many rounds), from the producers
            rounds = [v for _, v in stale0["train/sampling/rounds"]]
            assert max(rounds) > 1 and [v for _, v in stale0["train/async/groups_sampled"]] == [4.0 * r for r in rounds]
    assert check_bounded(read_run_metrics(out / "slow"), 1, 4, 4)[0] == 0.0
    assert check_bounded(read_run_metrics(out / "fast"), 1, 4, 4)[-1] == 1.0
