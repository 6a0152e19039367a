"""Checks of how the job runs, each refusing in one line naming the key and the fix: the strategy (one device, DDP
or FSDP2 through ``ModelParallelStrategy``; a DeepSpeed strategy named in the config before the trainer is built),
tensor parallelism, nodes started by hand, and vLLM servers launched where other nodes cannot reach them.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from sgrpo.checks import ConfigError


def check_strategy_name(strategy: Any) -> None:
    """A DeepSpeed strategy named in the config (``deepspeed``, ``deepspeed_stage_3_offload``, ...) refused before the
    trainer is built: Lightning would first raise its own error where DeepSpeed is not installed."""
    if isinstance(strategy, str) and strategy.strip().lower().startswith("deepspeed"):
        raise ConfigError(unsupported_strategy("DeepSpeedStrategy"))


def unsupported_strategy(name: str) -> str:
    return (
        f"trainer.strategy: {name} is not supported; shard with FSDP2 through "
        "lightning.pytorch.strategies.ModelParallelStrategy (configs/scale_deepmath_8gpu.yaml), or use ddp"
    )


def check_strategy(strategy: Any) -> None:
    """One device, DDP, or FSDP2 through ``ModelParallelStrategy``: the layouts sgrpo's rollouts and update keep
    in step. Lightning's ``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy`` shard in ways the rollout does not
    see: each process would leave its decode loop at its own step while the other waits in a collective."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy))
    if not supported or type(strategy).__name__ == "DeepSpeedStrategy":  # DeepSpeed's derives from DDP's
        raise ConfigError(unsupported_strategy(type(strategy).__name__))
    method = getattr(strategy, "_start_method", "popen")
    if method in ("spawn", "forkserver"):  # a traceback at launch: the fit's local callbacks do not pickle
        raise ConfigError(f"trainer.strategy: ddp_{method} sends the trainer to processes it starts, which sgrpo's "
                          "fit cannot be (it holds signal handlers and locks): use ddp, which starts the processes "
                          "running this command (or launch with torchrun)")  # fmt: skip


def check_tensor_parallel(strategy: Any) -> None:
    """``ModelParallelStrategy`` shards with FSDP2 over its data-parallel mesh only: no tensor-parallel plan is
    applied, so the peers of a tensor-parallel group would each sample their own seeds for the same prompts and
    the loss would count their tokens twice. ``tensor_parallel_size`` must be 1 (its "auto" means every device
    of a node)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy):
        return
    size = strategy._tensor_parallel_size
    resolved = strategy.num_processes if size == "auto" else size  # Lightning's "auto": the devices of a node
    nodes = max(1, getattr(strategy, "num_nodes", 1) or 1)
    world = max(1, strategy.num_processes) * nodes
    if isinstance(resolved, int) and resolved > 1:
        raise ConfigError(
            f"trainer.strategy: ModelParallelStrategy with tensor_parallel_size={size}"
            f"{f' ({resolved} devices)' if size == 'auto' else ''} is not implemented in sgrpo (no tensor-parallel "
            f"plan is applied; peers would sample the same prompts and count them twice): set "
            f"data_parallel_size={world} and tensor_parallel_size=1 (FSDP2 over every process)"
        )
    data = strategy._data_parallel_size
    if isinstance(data, int) and data != world:  # else a RuntimeError in every process once they start
        raise ConfigError(f"trainer.strategy: ModelParallelStrategy with data_parallel_size={data} over {world} "
                          f"processes (devices x num_nodes): set data_parallel_size={world}")  # fmt: skip


def check_launch_nodes(trainer: Any, policy: Any) -> None:
    """``launch`` starts vLLM servers on the first node; at a loopback ``host``, or one that names every interface
    (0.0.0.0, ::), another node's processes would call their own machine: refused with ``trainer.num_nodes > 1`` in
    one line naming the key."""
    nodes = getattr(trainer, "num_nodes", 1) or 1
    for key in ("rollout", "val_rollout"):
        launch = getattr(getattr(policy, key, None), "launch", None)
        if nodes > 1 and launch is not None and _this_machine_only(str(launch.host)):
            raise ConfigError(f"model.{key}.launch: the servers start on the first node at {launch.host}, which the "
                              f"other {nodes - 1} node(s) cannot reach: give launch.host an address they can, or start "
                              f"the servers yourself and list them in model.{key}.urls (docs/servers.md)")  # fmt: skip


def _this_machine_only(host: str) -> bool:
    """Whether calling ``host`` reaches the caller's own machine whichever node calls: a loopback address or name, or
    an unspecified one (a server listens on every interface there, but a client calling it reaches itself)."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a host name: whatever it resolves to on each node
        return False
    return address.is_loopback or address.is_unspecified


def check_episode_sharding(trainer: Any, policy: Any) -> None:
    """Multi-turn episodes on several FSDP2 processes decode on gathered weights: processes run different numbers
    of turns, so a forward that gathers its shards would wait for a process that does not come. A rollout with
    ``weights_snapshot: false`` raised at the first rollout, after every process had loaded and sharded the model:
    refused here in one line."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = max(1, getattr(trainer, "world_size", 1) or 1)
    if policy.environment is None or world < 2 or not isinstance(trainer.strategy, ModelParallelStrategy):
        return
    for key in ("rollout", "val_rollout"):
        if getattr(getattr(policy, key, None), "weights_snapshot", None) is False:
            raise ConfigError(f"model.{key}.init_args.weights_snapshot=false: multi-turn episodes (model.environment) "
                              f"over {world} FSDP2 processes decode on weights gathered once per rollout: set it to "
                              "null or true")  # fmt: skip


#: environment variables that describe the other nodes of a job launched by hand (Lightning's default environment)
_NODE_VARIABLES = ("NODE_RANK", "GROUP_RANK", "MASTER_ADDR")


def check_nodes(trainer: Any) -> None:
    """``trainer.num_nodes > 1`` started by hand (``python -m sgrpo.fit`` on one node, no srun or torchrun, none of
    ``_NODE_VARIABLES`` set) has process 0 wait for the other nodes in the rendezvous, silently, for the process
    group's timeout (30 minutes): refused in one line instead."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    nodes = getattr(trainer, "num_nodes", 1) or 1
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if nodes > 1 and type(environment) is LightningEnvironment and not any(v in os.environ for v in _NODE_VARIABLES):
        raise ConfigError(
            f"trainer.num_nodes={nodes}, but nothing started the other node(s) (no srun, torchrun or NODE_RANK): this "
            f"process would wait for them for 30 minutes. Launch on every node with srun (#SBATCH --nodes={nodes} "
            f"--ntasks-per-node=trainer.devices) or torchrun --nnodes={nodes}, or set NODE_RANK, MASTER_ADDR and "
            "MASTER_PORT on each node; on one node give --trainer.num_nodes=1 with data_parallel_size = the devices "
            "(configs/scale_deepmath_8gpu.yaml)"
        )
