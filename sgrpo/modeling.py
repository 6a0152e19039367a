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


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (``nn.Dropout`` modules and attention-dropout rates).

    RL on a policy's own samples needs the trained log-probs to be the sampling ones: with dropout
    on in training the on-policy ratio is not 1 (TRL and verl turn it off too). Returns how many
    modules changed.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p, changed = 0.0, changed + 1
        for name, value in list(vars(module).items()):  # e.g. attention_dropout: a float read in forward
            if "dropout" in name and isinstance(value, float) and value:
                setattr(module, name, 0.0)
                changed += 1
    return changed
