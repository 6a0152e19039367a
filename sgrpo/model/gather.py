"""Full tensors out of FSDP2 shards, many tensors per collective, cast before they travel: ``gathered``.

FSDP2 (``fully_shard``) holds each parameter as a DTensor sharded along dim 0 over a 1-D mesh: process r
keeps rows ``[r c, min((r + 1) c, rows))`` with ``c = ceil(rows / world)`` (``torch.chunk``; the last
processes may hold fewer rows, or none). ``gathered`` packs the local shards of a bucket of such
parameters, each cast to its target dtype first (bf16: half the bytes of float32) and padded to ``c``
rows, into one byte buffer (each section starting at a multiple of ``ALIGN`` bytes, so that a float32 section
after a bf16 one of an odd element count can be viewed as float32), gathers it with one collective
(``all_gather_single``), and cuts every full tensor out of the result. Other tensors: a plain tensor is only
cast; a DTensor placed otherwise (tensor parallelism, a 2-D mesh) is cast and gathered on its own
(``full_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator

import torch
from torch import Tensor

#: (key, tensor, dtype to cast it to before it is gathered, or None: its own)
Item = tuple[Hashable, Tensor, "torch.dtype | None"]

#: byte alignment of each tensor's section in a gathered bucket (the largest dtype's itemsize: complex128)
ALIGN = 16


def gathered(items: Iterable[Item], bucket_bytes: int = 0) -> Iterator[tuple[Hashable, Tensor]]:
    """(key, full plain tensor in its target dtype) for each item, in order, gathering a bucket at a time.

    A bucket holds items up to ``bucket_bytes`` of full tensors in their target dtypes (a larger one goes
    alone; 0: one tensor per bucket). Every process must pass the same keys, shapes and dtypes in the same
    order (each bucket is a collective).
    """
    bucket: list[Item] = []
    size = 0
    for item in items:
        nbytes = item[1].numel() * _itemsize(item[1], item[2])
        if bucket and size + nbytes > bucket_bytes:
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
    if bucket:
        yield from _gather_bucket(bucket)


def _itemsize(tensor: Tensor, dtype: torch.dtype | None) -> int:
    return (dtype or tensor.dtype).itemsize


def _row_sharded(tensor: Tensor) -> bool:
    """A DTensor sharded along dim 0 over a 1-D mesh (FSDP2's layout)."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tensor.dim() > 0
        and tuple(tensor.placements) == (Shard(0),)
    )


def _gather_bucket(bucket: list[Item]) -> Iterator[tuple[Hashable, Tensor]]:
    done: dict[int, Tensor] = {}
    groups: dict[object, list[int]] = {}
    for i, (_, tensor, dtype) in enumerate(bucket):
        if _row_sharded(tensor):
            groups.setdefault(tensor.device_mesh.get_group(), []).append(i)
        else:
            value = tensor.detach()
            value = value.to(dtype) if dtype is not None else value
            done[i] = value.full_tensor() if hasattr(value, "full_tensor") else value
    for group, indices in groups.items():
        done |= dict(zip(indices, _gather_rows([bucket[i][1:] for i in indices], group)))
    for i, (key, _, _) in enumerate(bucket):
        yield key, done.pop(i)


def _gather_rows(pairs: list[tuple[Tensor, torch.dtype | None]], group) -> list[Tensor]:
    """Full tensors of row-sharded DTensors over ``group``: one all-gather of their bytes into one buffer."""
    dist = torch.distributed
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = []  # (dtype, rows per process c, row shape, bytes per row, offset) per tensor
    offset = 0
    for tensor, dtype in pairs:
        dtype = dtype or tensor.dtype
        c = math.ceil(tensor.shape[0] / world)
        row_bytes = math.prod(tensor.shape[1:]) * dtype.itemsize
        offset = _aligned(offset)
        layout.append((dtype, c, tuple(tensor.shape), row_bytes, offset))
        offset += c * row_bytes
    offset = _aligned(offset)  # every process's part of the received buffer starts aligned too
    device = pairs[0][0].to_local().device
    send = torch.zeros(offset, dtype=torch.uint8, device=device)
    for (tensor, _), (dtype, c, shape, _, start) in zip(pairs, layout):
        local = tensor.to_local().detach().to(dtype).contiguous()
        if local.shape[0] != _rows_of(rank, shape[0], c):
            raise RuntimeError(f"a shard of {local.shape[0]} rows where FSDP2's layout has "
                               f"{_rows_of(rank, shape[0], c)} (rank {rank} of {world}, {shape[0]} rows)")  # fmt: skip
        send[start : start + local.numel() * dtype.itemsize] = local.view(-1).view(torch.uint8)
    received = torch.empty(world * offset, dtype=torch.uint8, device=device)
    # one collective into one buffer (torch >= 2.13 names it all_gather_single, before all_gather_into_tensor)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(received, send, group=group)
    out = []
    for dtype, c, shape, row_bytes, start in layout:
        pieces = []
        for r in range(world):
            rows = _rows_of(r, shape[0], c)
            at = r * offset + start
            pieces.append(received[at : at + rows * row_bytes].view(dtype).view(rows, *shape[1:]))
        out.append(torch.cat(pieces))
    return out


def _rows_of(rank: int, rows: int, c: int) -> int:
    """Rows that process ``rank`` holds of ``rows`` split in chunks of ``c`` (``torch.chunk``)."""
    return max(0, min(c, rows - rank * c))


def _aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of ``ALIGN``."""
    return -(-offset // ALIGN) * ALIGN
