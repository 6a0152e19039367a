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
* on CUDA (``graphs=True``) each bucket's step is captured once and replayed; elsewhere the same
  fixed-shape step runs eagerly, which is how the CPU tests check it against the model;
* ``GraphCache`` keeps the steps and their graphs across rollouts, one per shape (rows rounded up to a
  power of two, capacity to a multiple of ``CAPACITY_STEP``): a rollout copies its prefilled prompts into
  the kept buffers. Weights updated in place (the optimiser's step, ``load_state_dict``'s copy) keep their
  addresses, so the graphs read the current weights; the head's cast copy is refreshed in place
  (``LMHead.refresh``). When any weight's storage moves (a tensor replaced: ``load_state_dict(assign=True)``,
  a LoRA merge that swaps modules, FSDP2's per-rollout snapshot) every kept graph is dropped and recaptured. The
  kept steps hold the model's modules, not its tensors (``ModelHead``): a snapshot is freed before the update.

Sampling stays outside the graph (it draws from torch's generator). Same distribution as the eager
decoder: the same modules, weights and float32 head; only the attention's summation runs over
masked zero columns. Not yet measured on a GPU: ``HFRollout(cuda_graphs=True)`` opts in. The kept
graphs hold their buffers (the KV cache of the largest rollout of each shape) and memory pools between
rollouts, through the update: ``GraphCache.clear`` frees them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache

from sgrpo.model.head import LMHead

#: a kept step's capacity is the rollout's rounded up to a multiple of this (prompt widths vary per batch)
CAPACITY_STEP = 256


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

    def __init__(self, model: nn.Module, cache: DynamicCache, key_mask: Tensor, step_class, graphs: bool,
                 capture: Callable[[StaticSteps, int], tuple] | None = None) -> None:  # fmt: skip
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
        self.capture = capture or capture_graph  # (the tests' stand-in records and replays on the CPU)
        self.use_graphs = graphs and (device.type == "cuda" or capture is not None)
        self._pool = None

    @property
    def head(self) -> LMHead:
        return self.step.head

    def load(self, cache: DynamicCache, key_mask: Tensor, head: LMHead) -> None:
        """A new rollout: its prefilled ``cache`` (rows ``[R, kv_heads, >= P, D]``, P = each layer's length) and
        ``key_mask`` ``[R, C]`` (R and C at most this one's) copied into the kept buffers, the rest zeroed (rows past
        R attend to column 0 only); ``head``'s weight into the kept head. In place: the graphs stay valid."""
        rows, capacity = key_mask.shape
        for mine, layer in zip(self.layers, cache.layers, strict=True):
            n = layer.length
            for kept, new in ((mine.keys, layer.key_buffer), (mine.values, layer.value_buffer)):
                kept[:rows, :, :n].copy_(new[:, :, :n])
                kept[rows:, :, :n].zero_()
                kept[:, :, n:].zero_()
        self.key_mask.zero_()
        self.key_mask[:rows, :capacity] = key_mask
        self.key_mask[rows:, 0] = True
        self.head.refresh(head)

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
            self.graphs[b] = self.capture(self, b)
        graph, out = self.graphs[b]
        graph.replay()
        return out


def capture_graph(steps: StaticSteps, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """Record ``steps``' bucket-``b`` step as a CUDA graph, and its output (warm-up on a side stream first; a step
    is idempotent: it rewrites the same keys and values at the same column)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            steps._run(b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    dtype = torch.get_autocast_dtype("cuda")
    autocast = torch.autocast("cuda", dtype=dtype, enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
    # thread_local: only this thread's unsafe CUDA calls break the capture, not another thread's (a reward
    # pool's feeder, a logger's flush, the fault watcher) running while the step is recorded
    with autocast, torch.cuda.graph(graph, pool=steps._pool, capture_error_mode="thread_local"):
        out = steps._run(b)
    steps._pool = graph.pool()
    return graph, out


class ModelHead(LMHead):
    """``head``, whose weight is ``module``'s own parameter, reading it (and the bias) from ``module`` at each use: kept
    steps hold the module, never a tensor of it, so a rollout's weight snapshot (``sgrpo.rollout.snapshot``), whose
    tensors are replaced when it is freed, goes back before the update; a graph replayed later reads the parameter's
    current storage at the address ``storage_fingerprint`` checked."""

    def __init__(self, module: nn.Module, head: LMHead) -> None:
        self.module, self.dtype, self.transform, self._stacked = module, head.dtype, head.transform, {}

    @property
    def weight(self) -> Tensor:
        return self.module.weight

    @property
    def bias(self) -> Tensor | None:
        return self.module.bias


def storage_fingerprint(model: nn.Module) -> tuple:
    """Where every parameter and buffer of ``model`` lives (address, shape, strides, dtype): a captured graph reads
    them there, so it stays valid while this is unchanged (in-place updates keep it)."""
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


class GraphCache:
    """Decode steps and their CUDA graphs kept across rollouts (module docstring): one ``StaticSteps`` per shape
    (rows rounded up to a power of two, capacity to a multiple of ``CAPACITY_STEP``, the cache's dtype, autocast's),
    the ``max_shapes`` most recently used kept, every one dropped when a weight's storage moves
    (``storage_fingerprint``). ``capture`` records a graph (default ``capture_graph``: CUDA; the tests pass one that
    runs on the CPU). ``captures`` counts the graphs recorded, ``invalidations`` the times all were dropped."""

    def __init__(self, max_shapes: int = 2, capture: Callable[[StaticSteps, int], tuple] | None = None) -> None:
        self.max_shapes, self.capture = max_shapes, capture
        self.entries: OrderedDict[tuple, StaticSteps] = OrderedDict()
        self.fingerprint: tuple | None = None
        self.captures = self.invalidations = 0

    def steps(self, model: nn.Module, cache: DynamicCache, key_mask: Tensor, step_class, head: LMHead) -> StaticSteps:
        """The kept steps for this rollout's prefilled ``cache`` and ``key_mask`` ``[R, C]``, loaded with them."""
        fingerprint = storage_fingerprint(model)
        if fingerprint != self.fingerprint:
            self.invalidations += bool(self.entries)
            self.clear()
            self.fingerprint = fingerprint
        rows, capacity = key_mask.shape
        dtype = cache.layers[0].key_buffer.dtype
        autocast = torch.get_autocast_dtype(key_mask.device.type) if torch.is_autocast_enabled(key_mask.device.type) \
            else None  # fmt: skip
        shape = (bucket(rows, 1 << 30), -(-capacity // CAPACITY_STEP) * CAPACITY_STEP, dtype, autocast)
        entry = self.entries.pop(shape, None)
        if entry is None:
            entry = self._build(model, cache, shape, step_class, head)
        entry.load(cache, key_mask, head)
        self.entries[shape] = entry  # the most recently used last
        while len(self.entries) > self.max_shapes:
            self.entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Drop every kept step, its buffers and graphs."""
        self.entries.clear()

    def _build(self, model: nn.Module, cache: DynamicCache, shape: tuple, step_class, head: LMHead) -> StaticSteps:
        rows, capacity, dtype = shape[:3]
        layers = []
        for layer in cache.layers:
            _, kv_heads, _, dim = layer.key_buffer.shape
            buffers = [torch.zeros(rows, kv_heads, capacity, dim, dtype=dtype, device=layer.key_buffer.device)
                       for _ in range(2)]  # fmt: skip
            layers.append(SimpleNamespace(key_buffer=buffers[0], value_buffer=buffers[1], length=0))
        key_mask = torch.zeros(rows, capacity, dtype=torch.bool, device=cache.layers[0].key_buffer.device)
        if head.weight is model.get_output_embeddings().weight:  # the parameter itself: updated in place
            kept_head = ModelHead(model.get_output_embeddings(), head)
        else:  # a cast copy, refreshed in place by every rollout (``load``)
            kept_head = LMHead(head.weight.clone(), head.bias, head.transform, head.dtype)
        step = functools.partial(step_class, head=kept_head)
        graphs = key_mask.device.type == "cuda" or self.capture is not None  # else eager steps (CPU)
        return StaticSteps(model, SimpleNamespace(layers=layers), key_mask, step, graphs, capture=self._counted)

    def _counted(self, steps: StaticSteps, b: int) -> tuple:
        self.captures += 1
        return (self.capture or capture_graph)(steps, b)
