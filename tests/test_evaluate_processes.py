"""Evaluation (``sgrpo.fit validate|test``) over several processes: every process evaluates the checkpoint process 0
does (``sgrpo.evaluate.SameCheckpoint``). Split from tests/test_evaluate_export.py."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest

from sgrpo.export import CheckpointError


def _agree_on(rank: int, store: str, path: str, out) -> None:
    import torch.distributed as dist

    from sgrpo.evaluate import SameCheckpoint

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        SameCheckpoint(path).setup(SimpleNamespace(world_size=2), None, "validate")
        out.put((rank, None))
    except CheckpointError as err:
        out.put((rank, str(err)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("same", [True, False])
def test_processes_that_see_other_checkpoints_refuse_to_evaluate_them(same, tmp_path):
    """Each process resolves --ckpt_path last itself, seconds apart under Lightning's launcher: one that saw a
    checkpoint a running fit wrote meanwhile evaluated another model, its metrics synced with the others' (found by a
    review). Now the processes compare what they see before anything loads, and all refuse a difference."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    paths = [folder / "step2.ckpt", folder / ("step2.ckpt" if same else "step3.ckpt")]
    for path, data in zip(paths, (b"two", b"three")):
        if not path.exists():
            path.write_bytes(data)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    workers = [context.Process(target=_agree_on, args=(r, str(tmp_path / "store"), str(paths[r]), out))
               for r in (0, 1)]  # fmt: skip
    for worker in workers:
        worker.start()
    errors = dict(out.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    if same:
        assert errors == {0: None, 1: None}
    else:
        for error in errors.values():  # each names its own path
            assert "process 1 sees other bytes there than process 0" in error
            assert "so they would evaluate another state; nothing was loaded" in error
