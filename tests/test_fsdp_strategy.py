"""``trainer.strategy: fsdp`` (Lightning's FSDP1 names and class) runs as FSDP2, with a one-line notice.

The 2-process fit under ``--trainer.strategy=fsdp`` is a job of tests/test_sharded.py's first launch."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from sgrpo.fit import parse

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.mark.parametrize(
    "strategy",
    ["fsdp", "FSDP", "fsdp_cpu_offload", "lightning.pytorch.strategies.FSDPStrategy", "FSDPStrategy",
     '{"class_path": "lightning.pytorch.strategies.FSDPStrategy", "init_args": {"cpu_offload": false}}'],
)  # fmt: skip
def test_fsdp_is_built_as_fsdp2_with_one_notice(strategy, tmp_path, capsys):
    """Lightning refuses its FSDPStrategy on CPU and sgrpo's preflight refused it everywhere; mapped before the
    trainer is built, it is FSDP2 over every process (tensor parallelism 1), and says so once."""
    cli = parse(["--config", str(TINY), f"--trainer.strategy={strategy}", f"--trainer.default_root_dir={tmp_path}"])
    assert isinstance(cli.trainer.strategy, ModelParallelStrategy)
    assert cli.trainer.strategy._tensor_parallel_size == 1
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: trainer.strategy")]
    assert len(notes) == 1 and "runs as FSDP2" in notes[0], notes


def test_other_strategies_are_left_alone(tmp_path, capsys):
    cli = parse(["--config", str(TINY), "--trainer.strategy=ddp", f"--trainer.default_root_dir={tmp_path}"])
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert "runs as FSDP2" not in capsys.readouterr().err


def test_fsdp2_defers_gradient_sync_where_the_unsharded_gradients_fit(monkeypatch):
    """``gradient_sync: auto`` reduce-scatters once per optimiser step where the unsharded float32 gradients
    (4 bytes per trainable parameter) take at most 1/8 of the GPU (always on CPU), else after every micro-batch;
    "step" and "micro_batch" decide alone; a model that is not sharded never defers (DDP has no_sync)."""
    from types import SimpleNamespace

    import torch

    from sgrpo.distributed import defers_gradient_sync

    class Sharded(torch.nn.Linear):  # what sgrpo.distributed.is_sharded sees of an FSDP2 module
        def unshard(self):
            pass

    model = Sharded(1000, 1000, bias=False)  # 1M parameters: 4 MB of float32 gradients
    gpu = torch.device("cuda", 0)
    for memory, defers in ((32e6, True), (31.9e6, False)):  # 4 MB <= 1/8 of 32 MB
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _, m=memory: SimpleNamespace(total_memory=m))
        assert defers_gradient_sync("auto", model, gpu) is defers
        assert defers_gradient_sync("step", model, gpu) and not defers_gradient_sync("micro_batch", model, gpu)
    model.weight.requires_grad_(False)  # frozen (LoRA's base): no gradient to hold
    assert defers_gradient_sync("auto", model, gpu)
    assert defers_gradient_sync("auto", Sharded(1000, 1000), torch.device("cpu"))
    assert not defers_gradient_sync("step", torch.nn.Linear(2, 2), torch.device("cpu"))
