"""The trainer's weights in one shared-memory buffer for the asynchronous rollout producer (``sgrpo.rollout.producer``).

One buffer, not a shared tensor each: the producer's fork server passes each shared storage as a file descriptor and
refuses a process start that needs 252 or more (Python's ``MAXFDS_TO_SEND``), which a model of some 245 tensors
reaches (Qwen2.5-0.5B has 290). The trainer copies each push into it under a lock; the producer reads it through
``weight_views``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

#: byte alignment of each weight in the shared buffer (any dtype's itemsize divides it)
ALIGN = 64

Layout = list[tuple[str, int, torch.dtype, tuple[int, ...]]]  # (name, byte offset, dtype, shape) of each weight


def shared_weights(weights: Iterable[tuple[str, Tensor]]) -> tuple[Tensor, Layout]:
    """``weights`` copied into one shared-memory CPU byte buffer, and where each lies in it (``weight_views``).

    One buffer, not a shared tensor each: the producer's fork server passes each shared storage as a file descriptor
    and refuses a process start that needs 252 or more (Python's ``MAXFDS_TO_SEND``), which a model of some 245
    tensors reaches (Qwen2.5-0.5B has 290)."""
    values = [(name, value.detach()) for name, value in weights]
    layout: Layout = []
    size = 0
    for name, value in values:
        size = -(-size // ALIGN) * ALIGN
        layout.append((name, size, value.dtype, tuple(value.shape)))
        size += value.numel() * value.element_size()
    flat = torch.empty(max(size, 1), dtype=torch.uint8, device="cpu").share_memory_()
    views = weight_views(flat, layout)
    for name, value in values:
        views[name].copy_(value)
    return flat, layout


def weight_views(flat: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Each weight of ``shared_weights``' buffer as a tensor viewing it (writes go to the shared memory)."""
    views = {}
    for name, offset, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = flat[offset : offset + nbytes].view(dtype).view(shape)
    return views
