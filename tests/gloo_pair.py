"""Two forked gloo processes running one function each: what each put on the queue, by rank (torch and sgrpo are
already imported in the parent, so no interpreter starts)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path


def _on(target: Callable, rank: int, store: str, arg, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        out.put((rank, target(rank, arg)))
    finally:
        dist.destroy_process_group()


def run_pair(target: Callable, args: list, folder: Path, timeout: float = 60) -> dict[int, object]:
    """``target(rank, args[rank])`` on ranks 0 and 1 of a 2-process gloo group; returns ``{rank: its return}``.
    Each process must exit 0."""
    folder.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    workers = [context.Process(target=_on, args=(target, r, str(folder / "store"), args[r], out)) for r in (0, 1)]
    for worker in workers:
        worker.start()
    results = dict(out.get(timeout=timeout) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    return results
