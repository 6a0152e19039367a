"""Facts about the process group and the model's sharding, in one place.

Which collectives a step runs decides whether processes stay in step: under FSDP2 every forward
of a sharded module all-gathers its parameters, so every process must run the same number of
forwards; under DDP every synchronised backward all-reduces the whole gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn


def is_sharded(model: nn.Module | None) -> bool:
    """True for a model wrapped by FSDP2's ``fully_shard`` (its forwards are collectives)."""
    return model is not None and hasattr(model, "unshard")


def world_size() -> int:
    """Processes in the default group (1 when ``torch.distributed`` is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


#: bound ``close`` methods (weakly held) to call before the process group goes: engines built on it (vLLM)
_BEFORE_RELEASE: list[weakref.WeakMethod] = []


def close_before_release(close: Callable[[], None]) -> None:
    """Have ``release_process_group`` call the bound method ``close`` first (if its object still lives)."""
    _BEFORE_RELEASE.append(weakref.WeakMethod(close))


def release_process_group() -> None:
    """Destroy the default process group once every process is done with it (a barrier first).

    Lightning leaves it alive; a gloo group left to the interpreter's exit can abort a process there
    ("terminate called without an active exception", SIGABRT), which torchrun or SLURM then report as a
    failed job after a run that finished. Engines registered by ``close_before_release`` are closed
    first (vLLM's shutdown destroys its groups, and raised at exit once the default one was gone). A
    no-op without a process group.
    """
    while _BEFORE_RELEASE:
        close = _BEFORE_RELEASE.pop()()
        if close is not None:
            close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def any_process(flag: bool, device: torch.device) -> bool:
    """``flag`` OR-ed over all processes (a collective: every process must call it)."""
    if world_size() == 1:
        return flag
    value = torch.tensor(float(flag), device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


@contextlib.contextmanager
def gradient_sync(wrapper: nn.Module | None, enabled: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce in this block unless ``enabled``.

    Gradients of a micro-batch then accumulate locally; the next synchronised backward all-reduces
    the accumulated sum (``DistributedDataParallel.no_sync``). Anything but DDP is left alone.
    """
    if enabled or not isinstance(wrapper, nn.parallel.DistributedDataParallel):
        yield
        return
    with wrapper.no_sync():
        yield


def data_parallel_size(strategy) -> int:
    """How many processes hold different data under a Lightning ``strategy`` (1 on a single device)."""
    layout = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(layout.get("num_replicas", 1))


def data_parallel_rank(strategy) -> int:
    """This process's index among ``data_parallel_size(strategy)``."""
    layout = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(layout.get("rank", 0))


def max_over_processes(strategy, n: int) -> int:
    """The largest ``n`` over the processes of a Lightning ``strategy`` (a collective)."""
    return int(strategy.reduce(torch.tensor(float(n), device=strategy.root_device), reduce_op="max"))
