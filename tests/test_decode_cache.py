"""The decoder's KV cache and loop bookkeeping: blocks grown as rows get longer, keys in the values' dtype, the
running rows read every few tokens; the same tokens and log-probs as before in each case."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sgrpo.rollout.decode import BlockLayer, decode
from tests.test_decode import COMMON, _prompts


def test_cache_grows_in_blocks_up_to_its_capacity_with_keys_in_the_values_dtype():
    """A BlockLayer holds the positions written so far rounded up to a block (never more than its capacity),
    keeps what it holds when it grows or drops rows, stores float32 keys (rotary under autocast) in the
    values' bf16, and refuses to pass its capacity."""
    layer = BlockLayer(capacity=10, block=4)
    k, v = torch.randn(3, 2, 3, 8), torch.randn(3, 2, 3, 8).bfloat16()
    keys, values = layer.update(k, v)
    assert layer.key_buffer.shape == (3, 2, 4, 8) and layer.key_buffer.dtype == torch.bfloat16
    k2, v2 = torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8).bfloat16()
    keys, values = layer.update(k2, v2)
    assert layer.get_seq_length() == 5 and layer.value_buffer.shape == (3, 2, 8, 8)
    torch.testing.assert_close(keys, torch.cat([k, k2], 2).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v, v2], 2), rtol=0, atol=0)
    layer.batch_select_indices(torch.tensor([2, 0]))
    torch.testing.assert_close(layer.keys, torch.cat([k, k2], 2)[[2, 0]].bfloat16(), rtol=0, atol=0)
    layer.update(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8))  # 9 positions: the last block is cut at 10
    assert layer.key_buffer.shape == (2, 2, 10, 8)
    with pytest.raises(RuntimeError, match="capacity 10"):
        layer.update(torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 8))


def _eos_heavy_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        model.lm_head.weight[1] += 1.5 * model.model.norm.weight.sign()  # EOS likely: most rows end early
    return model


def _recording_caches(monkeypatch) -> list:
    import sgrpo.rollout.decode

    caches = []
    make = sgrpo.rollout.decode.kv_cache
    monkeypatch.setattr(sgrpo.rollout.decode, "kv_cache", lambda *a, **k: caches.append(make(*a, **k)) or caches[-1])
    return caches


@pytest.mark.parametrize("path", ["native", "forward", "fixed_shape"])
def test_cache_holds_keys_in_the_values_dtype_under_bf16_autocast(monkeypatch, path):
    """Under bf16-mixed (float32 weights, bf16 autocast) rotary embeddings promote keys to float32; the
    cache stores them in bf16 like the values (half the key memory, no re-cast of the whole cache at each
    token), on the native step, the model's own forward and the fixed-shape (CUDA-graph) steps."""
    caches = _recording_caches(monkeypatch)
    model = _eos_heavy_model()
    ids, mask = _prompts(torch.Generator().manual_seed(3))
    rows = torch.arange(3).repeat_interleave(2)
    options = {"native": {}, "forward": {"native_step": False}, "fixed_shape": {"cuda_graphs": True}}[path]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, logprobs = decode(model, ids, mask, rows, 6, [1], pad=0, **options)
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    for layer in caches[0].layers:
        assert layer.key_buffer.dtype == layer.value_buffer.dtype == torch.bfloat16


def test_cache_grows_with_the_rows_that_still_run_and_decodes_the_same(monkeypatch):
    """64 rows of a 40-token budget, most ending within a few tokens: the cache's largest allocation is a
    fraction of rows x (prompt + max_new_tokens) (what a preallocated cache holds from the start), and the
    sampled tokens and log-probs (same seed, fp32) equal those decoded with the cache allocated in one block."""
    caches = _recording_caches(monkeypatch)
    model = _eos_heavy_model()
    ids, mask = _prompts(torch.Generator().manual_seed(4))
    rows = torch.arange(3).repeat_interleave(22)[:64]
    update, sizes, peaks, runs = BlockLayer.update, {}, [], []

    def recording(layer, *args, **kwargs):  # the bytes all layers hold after each write
        out = update(layer, *args, **kwargs)
        sizes[id(layer)] = layer.key_buffer.nbytes + layer.value_buffer.nbytes
        peaks[-1] = max(peaks[-1], sum(sizes.values()))
        return out

    monkeypatch.setattr(BlockLayer, "update", recording)
    for block in (8, 64):
        sizes.clear()
        peaks.append(0)
        torch.manual_seed(5)
        runs.append(decode(model, ids, mask, rows, 40, [1], pad=0, cache_block=block))
    tokens = runs[0][0]
    lengths = torch.where((tokens == 1).any(-1), (tokens == 1).float().argmax(-1) + 1, 40)
    assert float(lengths.float().median()) <= 5 and int(lengths.max()) > 8  # most end early, some grow the cache
    layer = caches[0].layers[0]
    per_position = 2 * layer.key_buffer.shape[1] * layer.key_buffer.shape[3] * layer.key_buffer.element_size()
    preallocated = len(rows) * (ids.shape[1] + 40) * per_position * len(caches[0].layers)
    assert peaks[0] < 0.35 * preallocated, (peaks, preallocated)
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)


def test_running_rows_are_read_every_few_tokens_with_the_same_samples():
    """The host reads which rows still run (``int(tensor)``: a device sync on a GPU) every ``check_every``
    tokens, not at every token: counted as ``aten._local_scalar_dense`` calls. Without row drops the sampled
    tokens and log-probs (same seed) are those of reading at every token, and finished rows stay silent."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                HostReads.count += 1
            return func(*args, **(kwargs or {}))

    model = _eos_heavy_model()
    ids, mask = _prompts(torch.Generator().manual_seed(4))
    rows = torch.arange(3).repeat_interleave(4)
    reads, runs = {}, {}
    for every in (1, 4):
        torch.manual_seed(6)
        HostReads.count = 0
        with HostReads():
            runs[every] = decode(model, ids, mask, rows, 16, [1], pad=0, compact_below=0.0, check_every=every)
        reads[every] = HostReads.count
    for a, b in zip(runs[1], runs[4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    tokens, logprobs = runs[4]
    ended = (tokens == 1).any(-1)
    last = int(torch.where(ended, (tokens == 1).float().argmax(-1) + 1, 16).max())  # tokens the longest row took
    assert 8 <= last < 16
    # reading at every token: one read per token until none runs; every 4: at tokens 4, 8, ... until none runs
    assert reads[1] - reads[4] == last - math.ceil(last / 4), (reads, last)
    after = torch.arange(16) > (tokens == 1).float().argmax(-1, keepdim=True)
    assert (tokens[after & ended.unsqueeze(-1)] == 0).all() and (logprobs[after & ended.unsqueeze(-1)] == 0).all()


def test_cache_grows_geometrically_so_a_long_rollout_copies_it_a_few_times():
    """One position at a time to 1,000 with 16-position blocks: the buffers are reallocated (and the cache copied)
    7 times (16, 32, ..., 1,000: each growth at least doubles), not 63 times (one block at a time)."""
    layer = BlockLayer(capacity=1000, block=16)
    sizes = []
    for _ in range(1000):
        layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
        if not sizes or sizes[-1] != layer.key_buffer.shape[2]:
            sizes.append(layer.key_buffer.shape[2])
    assert sizes == [16, 32, 64, 128, 256, 512, 1000]
    assert layer.get_seq_length() == 1000 and layer.keys.shape[2] == 1000
