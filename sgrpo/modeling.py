"""Loading and placing the policy model: local folders or hub ids, and FSDP2 sharding."""

from __future__ import annotations

from pathlib import Path

import torch


def shard_model(model: torch.nn.Module, mesh) -> None:
    """FSDP2 ``fully_shard`` each transformer block (``model._no_split_modules``), then the root."""
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer blocks (_no_split_modules) to shard")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def resolve_model_path(path: str) -> str:
    """A local folder (relative to the working directory or to the sgrpo checkout), else a hub id."""
    for candidate in (Path(path).expanduser(), Path(__file__).resolve().parents[1] / path):
        if candidate.is_dir():
            return str(candidate)
    return path
