"""The trainer's weights in one shared-memory buffer for the asynchronous rollout producer (``sgrpo.rollout.producer``).

One buffer, not a shared tensor each: the producer's fork server passes each shared storage as a file descriptor and
refuses a process start that needs 252 or more (Python's ``MAXFDS_TO_SEND``), which a model of some 245 tensors
reaches (Qwen2.5-0.5B has 290). The trainer copies each push into it under a lock; the producer reads it through
``weight_views``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

#: byte alignment of each weight in the shared buffer (any dtype's itemsize divides it)
ALIGN = 64

Layout = list[tuple[str, int, torch.dtype, tuple[int, ...]]]  # (name, byte offset, dtype, shape) of each weight


def shared_weights(
    weights: Iterable[tuple[str, Tensor]], shapes: Sequence[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
) -> tuple[Tensor, Layout]:
    """``weights`` copied into one shared-memory CPU byte buffer, and where each lies in it (``weight_views``).

    One buffer, not a shared tensor each: the producer's fork server passes each shared storage as a file descriptor
    and refuses a process start that needs 252 or more (Python's ``MAXFDS_TO_SEND``), which a model of some 245
    tensors reaches (Qwen2.5-0.5B has 290). With ``shapes`` ((name, dtype, shape) of each weight, as
    ``sgrpo.model.lora.plain_layout`` gives them) the buffer is laid out first and each weight copied as it is
    yielded, so under FSDP2 one gathered bucket is on the device at a time, as in a push; without, the weights are
    all held first (the whole model gathered at once)."""
    values = None if shapes is not None else [(name, value.detach()) for name, value in weights]
    layout: Layout = []
    size = 0
    for name, dtype, shape in shapes if shapes is not None else [(n, v.dtype, tuple(v.shape)) for n, v in values]:
        size = -(-size // ALIGN) * ALIGN
        layout.append((name, size, dtype, tuple(shape)))
        size += math.prod(shape) * dtype.itemsize
    flat = torch.empty(max(size, 1), dtype=torch.uint8, device="cpu").share_memory_()
    views = weight_views(flat, layout)
    copied = set()
    for name, value in values if values is not None else weights:
        if name not in views:
            raise ValueError(f"the weights yielded {name}, which the layout lacks")
        views[name].copy_(value.detach())
        copied.add(name)
    if copied != set(views):
        raise ValueError(f"the weights yielded {sorted(set(copied) ^ set(views))[:3]} otherwise than laid out")
    return flat, layout


def weight_views(flat: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Each weight of ``shared_weights``' buffer as a tensor viewing it (writes go to the shared memory)."""
    views = {}
    for name, offset, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = flat[offset : offset + nbytes].view(dtype).view(shape)
    return views
