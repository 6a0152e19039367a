"""Facts about the process group and the model's sharding, in one place.

Which collectives a step runs decides whether processes stay in step: under FSDP2 every forward
of a sharded module all-gathers its parameters, so every process must run the same number of
forwards; under DDP every synchronised backward all-reduces the whole gradient.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch import nn


def is_sharded(model: nn.Module | None) -> bool:
    """True for a model wrapped by FSDP2's ``fully_shard`` (its forwards are collectives)."""
    return model is not None and hasattr(model, "unshard")


def world_size() -> int:
    """Processes in the default group (1 when ``torch.distributed`` is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


#: the process id of a process 0 that has claimed its run folder alone: the processes Lightning's launcher then
#: starts from it (with this environment) must not wait for its decision
STARTED_BY = "SGRPO_FOLDER_CLAIMED_BY"


def join_started_processes(strategy) -> bool:
    """Join the default process group now if the launcher started every process (srun, torchrun), before the
    trainer would; whether there is a group of more than one process afterwards.

    What only process 0 decides before a fit (the run folder: "in use", "holds a run") must reach the others
    (``first_refusal``): a process 0 that exited alone left every other one waiting in the rendezvous for the
    process group's timeout (30 minutes). The trainer then finds the group made. Processes that Lightning's
    launcher starts do not exist yet at this point: process 0 decides alone, before starting them.
    """
    if world_size() > 1:
        return True
    if os.environ.get(STARTED_BY) == str(os.getppid()):  # by Lightning's launcher, after process 0 decided alone
        return False
    environment = getattr(strategy, "cluster_environment", None)
    processes = getattr(strategy, "num_nodes", 1) * getattr(strategy, "num_processes", 1)
    if environment is None or not environment.creates_processes_externally or processes < 2:
        return False
    # Lightning's own set-up (ranks, backend, timeout): DDPStrategy.setup_distributed, ModelParallelStrategy's
    setup = getattr(strategy, "setup_distributed", None) or getattr(strategy, "_setup_distributed", None)
    if setup is None:
        return False
    setup()
    return world_size() > 1


@contextlib.contextmanager
def deciding_alone() -> Iterator[None]:
    """Mark this process, in its environment, as a process 0 whose decisions the processes Lightning's launcher
    starts from it (inside the block) do not wait for: they start only once it has decided."""
    os.environ[STARTED_BY] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(STARTED_BY, None)


_ROUNDS = itertools.count()  # every process calls first_refusal as often as the others: the same round names
_NONE = "-"


def store_key(name: str) -> str:
    """sgrpo's key ``name`` in the process group's store. Not per torchrun attempt: ``TORCHELASTIC_RESTART_COUNT``
    differs between the nodes after a restart (a node restarted for another's failure counts none), so keys built
    from it parted the processes of one attempt; an earlier attempt's keys in the agent's store stay a known
    limit (docs/scaling.md)."""
    return f"sgrpo/{name}"


def first_refusal(refusal: str | None, read_wait: float = 30.0) -> str | None:
    """The refusal of the lowest-ranked process that has one (else None), the same on every process: each calls
    this with its own (a collective, through the default group's store, which needs no device). ``refusal``
    as it is without a process group.

    Process 0 collects every process's answer and posts the decision; after a refusal it waits (up to
    ``read_wait`` s) until the others have read it, as its store ends with it.
    """
    if world_size() == 1:
        return refusal
    store = torch.distributed.distributed_c10d._get_default_store()
    rank, world, name = torch.distributed.get_rank(), world_size(), store_key(f"refusal/{next(_ROUNDS)}")
    store.set(f"{name}/{rank}", _NONE if refusal is None else f"!{refusal}")
    if rank == 0:
        answers = [store.get(f"{name}/{r}").decode() for r in range(world)]  # each waits for its process
        decision = next((a for a in answers if a != _NONE), _NONE)
        store.set(f"{name}/decision", decision)
        deadline = time.monotonic() + read_wait
        while decision != _NONE and store.add(f"{name}/read", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        decision = store.get(f"{name}/decision").decode()
        store.add(f"{name}/read", 1)
    return None if decision == _NONE else decision[1:]


#: bound ``close`` methods (weakly held) to call before the process group goes: engines built on it (vLLM)
_BEFORE_RELEASE: list[weakref.WeakMethod] = []


def close_before_release(close: Callable[[], None]) -> None:
    """Have ``release_process_group`` call the bound method ``close`` first (if its object still lives)."""
    _BEFORE_RELEASE.append(weakref.WeakMethod(close))


#: bound ``stop(grace)`` methods (weakly held) that ``sgrpo.run.faults.hard_exit`` calls: ``os._exit`` skips atexit
BEFORE_EXIT: list[weakref.WeakMethod] = []


def stop_before_exit(stop: Callable[[float], None]) -> None:
    """Have ``hard_exit`` call ``stop`` (servers launched in sessions of their own, which no kill of ours reaches)."""
    if weakref.WeakMethod(stop) not in BEFORE_EXIT:
        BEFORE_EXIT.append(weakref.WeakMethod(stop))


#: in the default group's store: a process that left without ``release_process_group`` (``leave_process_group``)
LEFT_KEY, RELEASED_KEY = store_key("left"), store_key("released")


def default_store():
    """The default process group's store, else None (no group, or a torch without it)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def leave_process_group(why: str) -> None:
    """Post in the store that this process leaves without ``release_process_group`` (its command failed here
    alone, or a signal cut the export here), so that the others' final barrier does not wait for it."""
    store = default_store() if world_size() > 1 else None
    if store is not None:
        with contextlib.suppress(Exception):  # the store's host is gone: no one is waiting on it
            store.set(LEFT_KEY, f"process {torch.distributed.get_rank()} {why}")


def released_after(command: Callable[[], Any]) -> None:
    """``command()``, then ``release_process_group``; if either raises (on this process alone, maybe: process 0's
    report, an engine's shutdown), ``leave_process_group`` first, so that no other process's final barrier waits
    for this one."""
    try:
        command()
        release_process_group()
    except BaseException as err:
        leave_process_group(f"ended with {type(err).__name__}")
        raise


#: seconds the final barrier waits in the store for a process that neither arrives nor says it left (killed: the
#: OOM killer, a crash), as long as the process group's own timeout
RELEASE_WAIT_S = 1800.0


def release_process_group(period: float = 0.05, wait: float = RELEASE_WAIT_S) -> None:
    """Destroy the default process group once every process is done with it (a barrier first).

    Lightning leaves it alive; a gloo group left to the interpreter's exit can abort a process there
    ("terminate called without an active exception", SIGABRT), which torchrun or SLURM then report as a
    failed job after a run that finished. Engines registered by ``close_before_release`` are closed
    first (vLLM's shutdown destroys its groups, and raised at exit once the default one was gone). A
    no-op without a process group.

    The processes first meet in the store, which also tells of a process that will not come: one that left
    (``leave_process_group``: process 0's report failed, a signal cut the export on one process) or whose
    store host (process 0) is gone. Then they skip the group's own barrier, where they waited for the process
    group's timeout (NCCL's: 30 minutes, holding every GPU), and leave the group to the interpreter's exit. One
    that neither comes nor says so (killed) is waited for ``wait`` seconds, then left likewise, with a line.
    """
    while _BEFORE_RELEASE:
        close = _BEFORE_RELEASE.pop()()
        if close is not None:
            close()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    store, world = default_store(), world_size()
    if store is not None and world > 1:
        deadline = time.monotonic() + wait
        try:
            arrived = store.add(RELEASED_KEY, 1)
            while arrived < world:
                said = store.check([LEFT_KEY])
                if said or time.monotonic() > deadline:
                    left = store.get(LEFT_KEY).decode() if said else "none said why"
                    print(f"{world - arrived} of {world} processes did not reach the end ({left})", file=sys.stderr)
                    return
                time.sleep(period)
                arrived = store.add(RELEASED_KEY, 0)
        except Exception:  # the store's host, process 0, is gone
            return
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
    """Skip the gradient all-reduce (DDP) or reduce-scatter (an FSDP2 module) in this block unless ``enabled``.

    Gradients of a micro-batch then accumulate locally (FSDP2: unsharded, in float32); the next synchronised
    backward reduces the accumulated sum (``DistributedDataParallel.no_sync``, FSDP2's
    ``set_requires_gradient_sync``). Anything else is left alone.
    """
    if enabled or wrapper is None:
        yield
    elif isinstance(wrapper, nn.parallel.DistributedDataParallel):
        with wrapper.no_sync():
            yield
    elif is_sharded(wrapper):
        wrapper.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapper.set_requires_gradient_sync(True)
    else:
        yield


#: share of the device's memory the unsharded float32 gradients may take for ``gradient_sync: auto`` to defer
DEFERRED_GRADIENT_SHARE = 1 / 8


def defers_gradient_sync(setting: str, model: nn.Module, device: torch.device) -> bool:
    """Whether an FSDP2 ``model`` reduce-scatters its gradients once per optimiser step (True) or after every
    micro-batch (False), for the policy's ``gradient_sync`` setting ("step", "micro_batch" or "auto").

    Deferring keeps the whole model's trainable gradients unsharded in float32 between micro-batches
    (4 bytes per trainable parameter: 6.2 GB for a 1.5B model, LoRA's adapters next to nothing); "auto" defers
    where that takes at most ``DEFERRED_GRADIENT_SHARE`` of every process's device memory (always on CPU).
    A collective for "auto" (every process decides alike). False for a model that is not sharded.
    """
    if not is_sharded(model) or setting == "micro_batch":
        return False
    if setting == "step":
        return True
    unsharded = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    if device.type == "cpu":
        fits = True
    elif device.type == "cuda":
        fits = unsharded <= DEFERRED_GRADIENT_SHARE * torch.cuda.get_device_properties(device).total_memory
    else:
        fits = False
    return not any_process(not fits, device)


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
    value = torch.tensor(float(n), dtype=torch.float64, device=strategy.root_device)  # exact under bf16-true
    return int(strategy.reduce(value, reduce_op="max"))


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over every process: Lightning's ``ModelParallelStrategy`` with ``data_parallel_size`` = the number of
    processes (``num_nodes`` x ``devices``, known once Lightning has resolved the devices) and no tensor
    parallelism. What ``trainer.strategy: fsdp`` runs (``fsdp_as_fsdp2``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


#: Lightning's registered names of its FSDP1 strategy, its class's name, and the name a user may guess for FSDP2
FSDP_NAMES = ("fsdp", "fsdp_cpu_offload", "fsdpstrategy", "fsdp2")


def fsdp_as_fsdp2(strategy: Any) -> Any:
    """``trainer.strategy``, with Lightning's FSDP (``fsdp``, ``fsdp_cpu_offload``, ``FSDPStrategy``) replaced
    by ``FSDP2Strategy``, which sgrpo keeps in step (one weight gather per rollout, lockstep decode, sharded
    checkpoints and export); prints a one-line notice on the first process. Anything else is returned as it is.

    FSDP1 gathers weights inside each wrapped forward, out of the rollout's sight; the process group backend and
    timeout of an ``FSDPStrategy`` carry over, its sharding options do not (FSDP2 shards each block).
    """
    if isinstance(strategy, str) and strategy.rsplit(".", 1)[-1].lower() in FSDP_NAMES:
        kwargs = {}
    elif isinstance(strategy, FSDPStrategy):
        kwargs = {"process_group_backend": strategy._process_group_backend, "timeout": strategy._timeout}
    else:
        return strategy
    if rank_zero_only.rank == 0:
        print(
            f"note: trainer.strategy {strategy if isinstance(strategy, str) else type(strategy).__name__} runs as "
            "FSDP2 (ModelParallelStrategy, data_parallel_size = all processes): sgrpo keeps FSDP2's collectives in "
            "step; FSDP1's options are not carried over",
            file=sys.stderr,
        )
    return FSDP2Strategy(**kwargs)
