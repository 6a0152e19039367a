"""CUDA graphs kept across rollouts (sgrpo.rollout.graphs.GraphCache), on the CPU: the capture is replaced by a
stand-in that records which tensors a real graph would read at their addresses and refuses to replay once one of
them has moved, then runs the step eagerly."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sgrpo.rollout.decode import decode
from sgrpo.rollout.graphs import CAPACITY_STEP, GraphCache, StaticSteps, storage_fingerprint
from sgrpo.rollout.snapshot import RolloutWeights

VOCAB = 40
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
EOS = [1, 5, 9]


class StaleGraph(AssertionError):
    """A replay after a tensor the graph reads has moved: a real graph would read freed or stale memory."""


class RecordedStep:
    """Stands in for a CUDA graph of ``steps``' bucket-``b`` step: it notes the address of every tensor a graph
    would read outside its own pool (the model's weights, the kept head, the kept buffers); ``replay`` refuses if
    any has moved, else runs the step eagerly into the output recorded at capture."""

    def __init__(self, model: torch.nn.Module, steps: StaticSteps, b: int) -> None:
        self.model, self.steps, self.b = model, steps, b
        self.addresses = self._addresses()
        self.out = steps._run(b)

    def _addresses(self) -> list[int]:
        head = self.steps.head
        kept = [head.weight, *head._stacked.values(), self.steps.key_mask, self.steps.tokens, self.steps.positions]
        kept += [t for layer in self.steps.layers for t in (layer.keys, layer.values)]
        return [t.data_ptr() for t in (*self.model.parameters(), *kept)]

    def replay(self) -> None:
        if self._addresses() != self.addresses:
            raise StaleGraph("a tensor the graph reads has moved")
        self.out.copy_(self.steps._run(self.b))


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def prompts(width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts, the longest ``width`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, width), generator=generator)
    mask = torch.ones(3, width, dtype=torch.long)
    mask[1, : width // 2] = 0
    mask[2, : width - 1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def rollout(model, cache: GraphCache | None, width: int = 5, seed: int = 3, groups: int = 8, tokens: int = 12):
    """Tokens and log-probs of one rollout (the same draws for a given seed), through ``cache``'s kept steps or,
    without one, the eager decoder."""
    ids, mask = prompts(width, seed)
    torch.manual_seed(seed)
    rows = torch.arange(3).repeat_interleave(groups)
    return decode(model, ids, mask, rows, tokens, EOS, pad=0, cuda_graphs=cache is not None, graph_cache=cache)


def assert_same(got, expected) -> None:
    """The same tokens; log-probs within 1e-5, or under bf16 autocast within its rounding: SDPA's blocks follow the
    key length, the fixed-shape step's (padded) or the eager one's (up to 5e-4 apart measured; one optimiser step
    of the weights moves them by ~4)."""
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    bf16 = torch.is_autocast_enabled("cpu")
    torch.testing.assert_close(got[1], expected[1], atol=2e-3 if bf16 else 1e-5, rtol=1e-5)


def cache_for(model=None) -> GraphCache:
    """A cache whose graphs are ``RecordedStep`` s over ``model`` (default: the model each step decodes)."""
    return GraphCache(capture=lambda steps, b: (graph := RecordedStep(model or steps.step.model, steps, b), graph.out))


def train_step(model, optimizer) -> None:
    model.train()
    loss = model(input_ids=torch.randint(2, VOCAB, (2, 6))).logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("autocast", [False, True])
def test_kept_graphs_are_replayed_across_rollouts_and_read_the_updated_weights(autocast):
    """Three rollouts with an AdamW step between them: the graphs captured in the first are replayed in the others
    (no capture after the first rollout), the optimiser's in-place update keeps every weight's address (the graphs
    read the new values) and every rollout samples what the eager decoder samples with the current weights. Under
    bf16 autocast the head's cast copy is refreshed in place (a copy made anew per rollout would leave the graphs
    reading the first rollout's head)."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    cache = cache_for(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for step in range(3):
            addresses = storage_fingerprint(model)
            assert_same(rollout(model, cache), rollout(model, None))
            if step == 0:
                captured = cache.captures
            train_step(model, optimizer)
            assert storage_fingerprint(model) == addresses  # updated in place
    assert captured > 0 and cache.captures == captured and cache.invalidations == 0
    assert len(cache.entries) == 1


def test_graphs_are_dropped_when_a_weights_storage_moves():
    """``load_state_dict(assign=True)`` replaces the tensors (as a LoRA merge that swaps modules or a reshard
    does): every kept graph is dropped and recaptured, and the rollout samples the new weights. Without the
    invalidation the stand-in refuses to replay (a real graph would read the old storage)."""
    model = llama()
    cache = cache_for(model)
    rollout(model, cache)
    first = cache.captures
    new = {name: torch.randn_like(t) * 0.2 for name, t in model.state_dict().items()}
    model.load_state_dict(new, assign=True)
    assert_same(rollout(model, cache), rollout(model, None))
    assert cache.invalidations == 1 and cache.captures == 2 * first
    model.load_state_dict({name: t * 0.5 for name, t in new.items()})  # copied in place: kept
    assert_same(rollout(model, cache), rollout(model, None))
    assert cache.invalidations == 1 and cache.captures == 2 * first
    model.load_state_dict({name: t.clone() for name, t in new.items()}, assign=True)
    cache.fingerprint = storage_fingerprint(model)  # as a cache that does not check: the stand-in refuses
    with pytest.raises(StaleGraph):
        rollout(model, cache)


def test_shapes_are_bucketed_and_the_least_recently_used_dropped():
    """One kept step per shape: rows rounded up to a power of two, capacity (prompt + new tokens) to a multiple of
    CAPACITY_STEP. Prompts of another width in the same capacity bucket reuse the graphs; a rollout past it adds a
    shape; beyond ``max_shapes`` the least recently used is dropped. Each samples what the eager decoder does."""
    model = llama()
    cache = cache_for(model)
    assert_same(rollout(model, cache, width=5, groups=8), rollout(model, None, width=5, groups=8))  # 24 rows
    assert list(cache.entries) == [(32, CAPACITY_STEP, torch.float32, None)]
    captured = cache.captures
    assert_same(rollout(model, cache, width=7, groups=7), rollout(model, None, width=7, groups=7))  # 21 rows
    assert cache.captures == captured and len(cache.entries) == 1  # the same bucket: replayed
    wide = CAPACITY_STEP - 8  # + 12 new tokens: past the first capacity bucket
    model.config.max_position_embeddings = 2 * CAPACITY_STEP
    model.model.rotary_emb.max_seq_len_cached = 2 * CAPACITY_STEP
    assert_same(rollout(model, cache, width=wide, groups=2), rollout(model, None, width=wide, groups=2))
    assert list(cache.entries)[-1] == (8, 2 * CAPACITY_STEP, torch.float32, None) and cache.captures > captured
    rollout(model, cache, width=5, groups=1)  # 3 rows: a third shape; the oldest (32 rows) goes
    assert [shape[:2] for shape in cache.entries] == [(8, 2 * CAPACITY_STEP), (4, CAPACITY_STEP)]


def test_without_a_capture_on_the_cpu_the_kept_steps_run_eagerly():
    """``GraphCache()`` as ``HFRollout(cuda_graphs=True)`` makes it: on the CPU no graph is captured (CUDA's calls
    would raise), the kept fixed-shape steps run eagerly across rollouts and sample what the eager decoder does."""
    model = llama()
    cache = GraphCache()
    for seed in (3, 4):
        assert_same(rollout(model, cache, seed=seed), rollout(model, None, seed=seed))
    assert cache.captures == 0 and len(cache.entries) == 1


def test_kept_graphs_hold_no_tensor_of_a_rollouts_weight_snapshot():
    """With the per-rollout weight snapshot (FSDP2's; forced on here) and no autocast the kept head reads the
    snapshot's own head weight: once the rollout ends (the snapshot's memory released before the update) no kept
    step holds a tensor of it (1 GB of head for a 7B model), and the next rollout, on a new snapshot of the updated
    weights, samples what the eager decoder does with them."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    weights, cache = RolloutWeights(True), cache_for()
    for _ in range(3):
        with weights(model) as snapshot:
            assert_same(rollout(snapshot, cache), rollout(snapshot, None))
            held = {name: weakref.ref(t) for name, t in (*snapshot.named_parameters(), *snapshot.named_buffers())}
        assert [name for name, ref in held.items() if ref() is not None] == []
        train_step(model, optimizer)
    assert cache.captures > 0 and len(cache.entries) == 1
