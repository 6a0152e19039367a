"""Two forked gloo processes running one function each: what each put on the queue, by rank (torch and sgrpo are
already imported in the parent, so no interpreter starts)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A one-process gloo group in this interpreter (the test is skipped where one exists already), destroyed after:
    FSDP2 on CPU with a mesh of one."""
    import socket

    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this interpreter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
