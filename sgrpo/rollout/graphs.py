"""Fixed-shape decode steps that CUDA graphs can replay: the launch-free rollout path (off by default).

A decode step of a small batch launches a few hundred kernels (a dozen per layer) of a few
microseconds each; on a GPU that launch overhead, not arithmetic, bounds the rollout. A CUDA graph
replays a recorded step with one launch, but needs every tensor at a fixed address with a fixed
shape. ``StaticSteps`` provides that around ``LlamaFamilyStep``:

* keys and values stay in the rollout's cache buffers, grown to ``[R, kv_heads, capacity, D]`` up front; the
  new token's are written at a column held in a device tensor (``index_copy_``), and attention runs
  over the whole capacity with a key mask (unwritten columns are zero and masked out);
* finished rows are dropped by moving the running rows to the front of every buffer, in place, and a
  step runs on the first ``b`` rows, ``b`` the smallest bucket (a power of two) holding them, as
  vLLM pads a batch up to its next captured size; rows past the running ones compute and are ignored;
* on CUDA (``graphs=True``) each bucket's step is captured once per rollout and replayed; elsewhere
  the same fixed-shape step runs eagerly, which is how the CPU tests check it against the model.

Sampling stays outside the graph (it draws from torch's generator). Same distribution as the eager
decoder: the same modules, weights and float32 head; only the attention's summation runs over
masked zero columns. Not yet measured on a GPU: ``HFRollout(cuda_graphs=True)`` opts in.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache


class StaticLayer:
    """One layer's cache as fixed buffers: ``update`` writes the new token at ``column`` for the first rows."""

    def __init__(self, keys: Tensor, values: Tensor, column: Tensor) -> None:
        self.keys, self.values, self.column = keys, values, column

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``key``/``value`` ``[b, kv_heads, 1, D]`` -> the first b rows' buffers ``[b, kv_heads, capacity, D]``."""
        b = key.shape[0]
        self.keys[:b].index_copy_(2, self.column, key.to(self.keys.dtype))  # keys in the values' dtype
        self.values[:b].index_copy_(2, self.column, value)
        return self.keys[:b], self.values[:b]


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= ``n``, at most ``limit``."""
    return min(limit, 1 << max(0, n - 1).bit_length())


class StaticSteps:
    """Fixed-shape decode steps over a prefilled ``cache`` of ``BlockLayer`` s at full capacity, one row per sequence.

    ``key_mask`` ``[R, capacity]``: the prompt columns each row attends to (the rest are set as
    tokens arrive). ``step_class`` is the native step (``sgrpo.rollout.decode.LlamaFamilyStep``).
    """

    def __init__(self, model: nn.Module, cache: DynamicCache, key_mask: Tensor, step_class, graphs: bool) -> None:
        rows, capacity = key_mask.shape
        device = key_mask.device
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.layers = []
        for layer in cache.layers:
            for buffer in (layer.key_buffer, layer.value_buffer):
                buffer[:, :, layer.length :].zero_()  # masked columns must hold numbers, not garbage
            self.layers.append(StaticLayer(layer.key_buffer, layer.value_buffer, self.column))
        self.step = step_class(model, SimpleNamespace(layers=self.layers), capacity)
        self.key_mask = key_mask.bool().clone()
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.limit = rows
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.use_graphs = graphs and device.type == "cuda"
        self._pool = None

    def compact(self, keep: Tensor) -> None:
        """Move rows ``keep`` to the front of every buffer (in place: the graphs' addresses stay valid)."""
        n = len(keep)
        for layer in self.layers:
            layer.keys[:n] = layer.keys[keep]
            layer.values[:n] = layer.values[keep]
        self.key_mask[:n] = self.key_mask[keep]

    def __call__(self, tokens: Tensor, positions: Tensor, column: int) -> Tensor:
        """float32 logits ``[n, V]`` for the first n rows' new ``tokens`` at ``positions``, written at ``column``."""
        n = tokens.shape[0]
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.column.fill_(column)
        self.key_mask[:, column] = True
        b = bucket(n, self.limit)
        return (self._replay(b) if self.use_graphs else self._run(b))[:n]

    def _run(self, b: int) -> Tensor:
        return self.step(self.tokens[:b], self.positions[:b], self.key_mask[:b])

    def _replay(self, b: int) -> Tensor:
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Record the bucket-``b`` step (warm-up on a side stream first; a step is idempotent: it rewrites
        the same keys and values at the same column)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        dtype = torch.get_autocast_dtype("cuda")
        autocast = torch.autocast("cuda", dtype=dtype, enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        # thread_local: only this thread's unsafe CUDA calls break the capture, not another thread's (a reward
        # pool's feeder, a logger's flush, the fault watcher) running while the step is recorded
        with autocast, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._run(b)
        self._pool = graph.pool()
        return graph, out
