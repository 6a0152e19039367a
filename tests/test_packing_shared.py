"""A group's prompt computed once in packed rows (sgrpo.model.packing.pack_shared): the layout by hand, log-probs and
gradients equal to the unshared computation, no completion seeing another, the block mask for each attention
implementation, and where sharing is refused."""

from __future__ import annotations

import pytest
import torch

from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.packing import SharedPacked, pack_shared, shared_pays, sharing_problem
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, TokenBatch

TOKENIZER = build_char_tokenizer()


def tiny(attention: str = "sdpa", dtype: torch.dtype = torch.float32):
    model = build_tiny_llama(TOKENIZER, num_layers=2).to(dtype)
    model.config._attn_implementation = attention
    return model


def grouped_batch(groups: int = 3, g: int = 4, p: int = 9, t: int = 7, seed: int = 0):
    """``groups`` groups of ``g`` rows: per group one left-padded prompt (2..p tokens), per row a right-padded
    completion (1..t tokens)."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * g
    ids = torch.randint(3, 17, (n, p + t), generator=gen)
    attention = torch.ones_like(ids)
    completion = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n):
        if i % g == 0:
            prompt = int(torch.randint(2, p + 1, (1,), generator=gen))
        else:
            ids[i, :p] = ids[i - 1, :p]
        length = int(torch.randint(1, t + 1, (1,), generator=gen))
        attention[i, : p - prompt] = 0
        attention[i, p + length :] = 0
        completion[i, :length] = True
    return ids * attention, attention, completion


def test_pack_shared_lays_out_a_small_batch_by_hand():
    # rows 0 and 2 share prompt [5, 6]: completions [7, 8] (runs 7) and [9] (runs nothing: predicted from 6); row 1
    # has prompt [4] and completion [3, 2, 1] (runs 3 2). Segments: [5 6 | 7] (3 tokens, 2 branches), [4 | 3 2] (3).
    ids = torch.tensor([[5, 6, 7, 8, 0], [0, 4, 3, 2, 1], [5, 6, 9, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    completion = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    packed = pack_shared(ids, attention, completion)  # rows as wide as the widest segment (3)
    # torch.unique orders the prompts: [0, 4] (group 0: row 1) before [5, 6] (group 1: rows 0 and 2)
    assert packed.input_ids.tolist() == [[4, 3, 2], [5, 6, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert packed.branch.tolist() == [[0, 2, 2], [0, 0, 1]]
    assert packed.segment.tolist() == [[0, 0, 0], [1, 1, 1]]
    # trained tokens row-major: row 0's 7, 8 (from 6, 7: slots 3 + 1, 3 + 2), row 1's 3, 2, 1 (from 4, 3, 2: 0, 1,
    # 2), row 2's 9 (from the prompt's last slot, 6: 3 + 1)
    assert packed.hidden_index.tolist() == [4, 5, 0, 1, 2, 4]
    assert packed.tokens == 6


def test_block_mask_by_hand():
    # one row: prompt (2), completion a (2), completion b (1), one padding slot
    packed = SharedPacked(
        torch.zeros(1, 6, dtype=torch.long), torch.tensor([[0, 1, 2, 3, 2, 0]]), torch.tensor([[0, 0, 0, 0, 0, 7]]),
        torch.tensor([[0, 0, 1, 1, 2, 0]]), torch.zeros(0, dtype=torch.long), 5,
    )  # fmt: skip
    assert packed.allowed()[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # b sees the prompt and itself, not a
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


def shared_taken(monkeypatch) -> list[int]:
    """Count calls of ``pack_shared`` inside ``completion_logprobs`` (the shared path really ran)."""
    import sgrpo.model.logprobs as logprobs

    calls: list[int] = []
    original = logprobs.pack_shared
    monkeypatch.setattr(logprobs, "pack_shared", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize(
    ("attention", "dtype", "tolerance"),
    [("eager", torch.float32, 1e-6), ("sdpa", torch.float32, 1e-6), ("eager", torch.float64, 1e-6),
     ("sdpa", torch.float64, 1e-6)],
)  # fmt: skip
def test_shared_log_probs_equal_the_unshared_ones(monkeypatch, attention, dtype, tolerance):
    """Log-probs and entropies with each prompt once equal the unshared packed path's (float32 logits: 1e-6; that
    path equals the padded one, tests/test_packing.py, which in eager fp64 turns left-padded rows into NaN)."""
    calls = shared_taken(monkeypatch)
    model = tiny(attention, dtype).eval()
    for seed in range(3):
        ids, mask, completion = grouped_batch(seed=seed)
        with torch.no_grad():
            a, ea = completion_logprobs(model, ids, mask, completion, 0.7, with_entropy=True, share_prompts=False,
                                        packing=True)
            b, eb = completion_logprobs(model, ids, mask, completion, 0.7, with_entropy=True, packing=True)
        torch.testing.assert_close(b, a, rtol=0, atol=tolerance)
        torch.testing.assert_close(eb, ea, rtol=0, atol=tolerance)
        assert torch.equal(b == 0, ~completion)
    assert len(calls) == 3


def loss_gradients(ids, mask, completion, aggregation, packing, lora=False, dtype=torch.float32):
    """Parameter gradients (LoRA: the adapters', B initialised away from 0 so they act) of the clipped surrogate with
    KL; packed runs share prompts, padded ones do not."""
    from sgrpo.model.lora import LoRA, apply_lora

    model = tiny("sdpa")
    if lora:
        apply_lora(model, LoRA(rank=4, dropout=0.0))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
    model = model.to(dtype)
    n = len(ids)
    logp, _ = completion_logprobs(model, ids, mask, completion, packing=packing, share_prompts=packing)
    old, ref = logp.detach() - 0.05 * completion, logp.detach() + 0.1 * completion
    batch = TokenBatch(logp, old, torch.linspace(-1, 1, n), completion, ref, None)
    loss, _ = ClippedSurrogate(aggregation=aggregation, kl_coef=0.1)(batch, BatchCounts(n, completion.sum(), 7))
    loss.backward()
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_const"])
def test_shared_gradients_equal_the_unshared_ones(monkeypatch, aggregation):
    """Parameter gradients of the clipped surrogate with KL, for each loss aggregation: within 1e-6 relative (fp32)."""
    calls = shared_taken(monkeypatch)
    batch = grouped_batch(groups=2, g=4, seed=5)
    padded, shared = (loss_gradients(*batch, aggregation, packing) for packing in (False, True))
    assert calls == [1]
    assert padded.abs().max() > 0
    assert float((shared - padded).norm() / padded.norm()) < 1e-6


def test_shared_gradients_with_lora():
    """LoRA adapters' gradients: the two float32 paths are 1.6e-6 (relative) apart for token_mean, each ~1.9e-6 from
    a float64 run (float32 logits in both): so the test asks 3e-6 between them, and the shared path no farther
    from the float64 run than the padded one (1e-6 slack)."""
    batch = grouped_batch(groups=2, g=4, seed=5)
    for aggregation in ("token_mean", "seq_sum_const"):
        truth = loss_gradients(*batch, aggregation, False, lora=True, dtype=torch.float64)
        padded, shared = (loss_gradients(*batch, aggregation, packing, lora=True) for packing in (False, True))
        assert padded.norm() > 0
        assert float((shared - padded).norm() / padded.norm()) < 3e-6
        assert float((shared - truth).norm()) <= float((padded - truth).norm()) + 1e-6 * float(truth.norm())


def test_no_completion_sees_another_and_no_cache(monkeypatch):
    """Changing one completion's tokens leaves every other row's log-probs unchanged bit for bit (its siblings', which
    share its prompt and packed row, included); changing a prompt changes its whole group; no DynamicCache is made."""
    from transformers import cache_utils

    made = []
    original = cache_utils.DynamicCache.__init__
    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", lambda s, *a, **k: made.append(1) or original(s, *a, **k))
    calls = shared_taken(monkeypatch)
    model = tiny("sdpa").eval()
    ids, mask, completion = grouped_batch(groups=2, g=4, seed=1)
    p = ids.shape[1] - completion.shape[1]
    with torch.no_grad():
        base, _ = completion_logprobs(model, ids, mask, completion, packing=True)
        for i in range(len(ids)):
            changed = ids.clone()
            changed[i, p:] = torch.where(mask[i, p:] > 0, (ids[i, p:] - 3 + 1) % 14 + 3, 0)
            other, _ = completion_logprobs(model, changed, mask, completion, packing=True)
            keep = torch.arange(len(ids)) != i
            assert torch.equal(other[keep], base[keep])
            if completion[i].sum() > 1:
                assert not torch.equal(other[i], base[i])
        changed = ids.clone()
        changed[:4, p - 1] = changed[:4, p - 1] % 14 + 4  # group 0's last prompt token
        other, _ = completion_logprobs(model, changed, mask, completion, packing=True)
    assert (other[:4] != base[:4]).any(-1).all() and torch.equal(other[4:], base[4:])
    assert made == [] and len(calls) == len(ids) + 2


@pytest.mark.slow
def test_flex_block_mask_equals_the_dense_mask():
    """The flex-attention ``BlockMask`` keeps what ``allowed`` keeps: flex attention (uncompiled, on CPU) over it
    equals SDPA over the dense bool mask."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention
    from torch.nn.functional import scaled_dot_product_attention

    from sgrpo.model.packing import shared_attention_mask

    ids, mask, completion = grouped_batch(groups=3, g=4, seed=2)
    packed = pack_shared(ids, mask, completion, hidden_size=8)
    model = tiny("flex_attention")
    block = shared_attention_mask(model, packed)
    rows, width = packed.input_ids.shape
    q, k, v = torch.randn(3, rows, 2, width, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dense = scaled_dot_product_attention(q, k, v, attn_mask=packed.allowed())
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block), dense, rtol=0, atol=1e-12)


def test_sharing_refused_where_the_mask_cannot_say_it():
    assert sharing_problem(tiny("sdpa")) is None and sharing_problem(tiny("eager")) is None
    assert "takes no block mask" in sharing_problem(tiny("flash_attention_2"))
    model = tiny("sdpa")
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding window" in sharing_problem(model)
    # Mistral (and Phi-3, Starcoder2) slide whenever ``sliding_window`` is set, with no ``use_sliding_window`` and
    # no ``layer_types``: shared prompts were run under the block mask without the window (log-probs off by 0.015
    # past it); Qwen2 sets a window it uses only with ``use_sliding_window``
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2, "attn_implementation": "sdpa"}  # fmt: skip
    assert "sliding window" in sharing_problem(MistralForCausalLM(MistralConfig(sliding_window=40, **small)))
    assert sharing_problem(MistralForCausalLM(MistralConfig(sliding_window=None, **small))) is None
    assert sharing_problem(Qwen2ForCausalLM(Qwen2Config(sliding_window=40, use_sliding_window=False, **small))) is None
    assert "sliding window" in sharing_problem(
        Qwen2ForCausalLM(Qwen2Config(sliding_window=40, use_sliding_window=True, **small)))


def test_shared_pays_by_the_cost_model():
    """Long prompts shared by many completions pay; no repeated prompt, or single tokens after long completions, do
    not (the dense mask's quadratic term over one wide segment outweighs a small prompt)."""
    ids, mask, completion = grouped_batch(groups=2, g=8, p=30, t=4, seed=0)
    assert shared_pays(mask, completion, ids, 64)
    distinct = torch.arange(len(ids)).unsqueeze(-1) % 14 + 3
    ids_distinct = torch.where(mask[:, :30] > 0, distinct, 0)
    assert not shared_pays(mask, completion, torch.cat([ids_distinct, ids[:, 30:]], 1), 64)



def test_segment_parts_by_hand():
    """cost(L) = L + L^2 / 6H. H 2, prompt 3, completions 60 and 60: adding the second to the first's segment costs
    cost(123) - cost(63) = 990, a part of its own cost(63) = 393.75: two parts. H 256, prompt 300, completions 10,
    20, 30: one part (adding 20 to 330 tokens costs 28.9, a new part 386.7). With a budget of 410: 30 alone (cost
    400.9), 20 would pass it there (429.8): a new part, which 10 then joins (400.9)."""
    from sgrpo.model.rows import segment_parts

    assert segment_parts(3, [60, 60], 2) == [[0], [1]]
    assert segment_parts(300, [10, 20, 30], 256) == [[2, 1, 0]]
    assert segment_parts(300, [10, 20, 30], 256, budget=410) == [[2], [1, 0]]
    assert segment_parts(3, [60, 60], None) == [[0, 1]]  # no hidden size: tokens only, one part


def test_a_group_cut_into_parts_gives_the_same_log_probs():
    """Where the cost model cuts a group into parts (each with its own prompt copy), the hidden states that predict
    the trained tokens equal the unshared packed ones (SDPA, float64)."""
    from sgrpo.model.logprobs import final_hidden_states
    from sgrpo.model.packing import pack

    model = tiny("sdpa", torch.float64).eval()
    ids, mask, completion = grouped_batch(groups=2, g=3, p=4, t=30, seed=0)
    shared = pack_shared(ids, mask, completion, hidden_size=1)
    assert len(set(shared.segment.flatten().tolist()) & set(range(6))) > 2  # more segments than groups
    plain = pack(ids, mask, completion)
    with torch.no_grad():
        a, b = (final_hidden_states(model, x.input_ids, m, position_ids=x.position_ids)
                for x, m in ((plain, None), (shared, shared.allowed())))  # fmt: skip
    a, b = (h.reshape(-1, h.shape[-1])[x.hidden_index] for h, x in ((a, plain), (b, shared)))
    torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def verdict_of(model, packing=True, share_prompts=True):
    """``PolicyUpdate._packing_verdict`` on a stand-in policy (one process, rank 0, CPU)."""
    from types import SimpleNamespace

    from sgrpo.train.update import PolicyUpdate

    policy = SimpleNamespace(packing=packing, share_prompts=share_prompts, device=torch.device("cpu"),
                             trainer=SimpleNamespace(is_global_zero=True))  # fmt: skip
    return PolicyUpdate._packing_verdict(policy, model)


def test_the_start_names_the_attention_path_and_sharing_falls_back_with_one_warning(monkeypatch, caplog):
    """One info line names the path; a model whose attention takes no block mask keeps packing but not sharing, with
    one warning naming why; a model whose block mask leaks (a probe sees one completion change another's log-probs)
    likewise; ``share_prompts: false`` shares nothing and warns nothing."""
    import logging

    import sgrpo.model.packed_path as packed_path

    assert packed_path.shared_packing_problem(tiny("eager")) is None
    with caplog.at_level(logging.INFO, logger="sgrpo.train.update"):
        assert verdict_of(tiny("sdpa")) == (True, True)
        assert verdict_of(tiny("sdpa"), share_prompts=False) == (True, False)
        model = tiny("sdpa")
        model.config.layer_types = ["sliding_attention"] * 2
        assert verdict_of(model) == (True, False)
        leaky = tiny("sdpa")
        monkeypatch.setattr(SharedPacked, "allowed", lambda self: (self.segment.unsqueeze(-1) == self.segment.unsqueeze(
            -2)).tril().unsqueeze(1))  # fmt: skip
        assert verdict_of(leaky) == (True, False)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("INFO", "model.packing: packed log-probs, SDPA with a packed mask, rows of the width a cost "
                        "model picks, each group's prompt once where the cost model says it pays")
    assert lines[1] == ("INFO", "model.packing: packed log-probs, SDPA with a packed mask, rows of the width a cost "
                        "model picks")  # fmt: skip
    fallback = "model.share_prompts: packed rows hold each completion's own prompt copy: "
    assert lines[3][0] == "WARNING" and lines[3][1].startswith(fallback + "layers of kinds ['sliding_attention']")
    assert lines[5][0] == "WARNING" and "one completion's log-probs change with another's tokens" in lines[5][1]
    assert len(lines) == 6


def test_attention_chosen_by_device_and_named():
    from sgrpo.model.packed_path import attention_path, choose_attention, preferred_attention

    assert preferred_attention("cpu", True, True) is None  # SDPA with the packed mask
    assert preferred_attention("cuda", True, True) == "flash_attention_2"
    assert preferred_attention("cuda", False, True) == "flex_attention"
    assert preferred_attention("cuda", False, False) is None
    assert preferred_attention("cuda", True, True, half=False) == "flex_attention"  # flash-attention takes no float32
    assert preferred_attention("cuda", True, False, half=False) is None
    model = tiny("sdpa")
    assert choose_attention(model, "cpu") == "sdpa"
    model.config._attn_implementation = "flash_attention_2"
    assert attention_path(model, False).startswith("flash_attention_2: the varlen kernel over one packed row")
    model.config._attn_implementation = "flex_attention"
    assert attention_path(model, True).startswith("flex attention with a BlockMask")


def test_a_probe_that_raises_falls_back_to_the_padded_path_with_the_attention_it_had(monkeypatch, caplog):
    """An attention kernel that refuses the probe's inputs (flash-attention given float32) ends in the padded path
    with one warning naming the error, and the model gets back the attention implementation it ran before."""
    import logging

    import sgrpo.train.micro_logprobs as micro

    def switch(model, device_type):
        model.config._attn_implementation = "eager"  # stands in for a switch to flash-attention

    def refuse(model):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    monkeypatch.setattr(micro, "choose_attention", switch)
    monkeypatch.setattr(micro, "packing_problem", refuse)
    model = tiny("sdpa")
    restored = []
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda self, impl: restored.append(impl) or setattr(
        self.config, "_attn_implementation", impl), raising=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sgrpo.train.update"):
        assert verdict_of(model) == (False, False)
    assert restored == ["sdpa"] and model.config._attn_implementation == "sdpa"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("model.packing: falling back to padded log-probs: the check raised RuntimeError: FlashAttention "
                    "only support fp16 and bf16 data type")


def saved_masks(loss: torch.Tensor) -> set[int]:
    """The storages of the attention masks the autograd graph under ``loss`` saved for its backward."""
    found, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "_saved_attn_mask") and node._saved_attn_mask is not None:
            found.add(node._saved_attn_mask.untyped_storage().data_ptr())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.float64, False), (torch.float32, True)])
def test_sdpa_saves_one_block_mask_for_every_layer_and_the_bool_masks_values(dtype, autocast):
    """SDPA turns a bool mask into a float copy in each layer and saves it (one [R, 1, C, C] per layer): the shared
    path hands it one additive mask that every layer saves by reference, with the bool mask's values bit for bit.
    Under bf16 autocast (bf16-mixed) too: a float32 mask was cast to a bf16 copy in each layer (found by a review)."""
    from sgrpo.model.logprobs import final_hidden_states
    from sgrpo.model.packing import shared_attention_mask

    model = tiny("sdpa", dtype)
    ids, mask, completion = grouped_batch(seed=1)
    packed = pack_shared(ids, mask, completion)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        block = shared_attention_mask(model, packed)
        hidden = final_hidden_states(model, packed.input_ids, block, position_ids=packed.position_ids)
        assert len(saved_masks(hidden.sum())) == 1 < model.config.num_hidden_layers
        with torch.no_grad():
            plain = final_hidden_states(model, packed.input_ids, packed.allowed(), position_ids=packed.position_ids)
    assert torch.equal(hidden.detach(), plain)


def test_a_row_without_trained_tokens_runs_none_and_leaves_the_others_whole():
    """``sequence_lengths`` keeps no column of a row with no trained token (its prompt used to be kept, and
    ``pack_shared`` wrote it at offset 0 over the first segment's tokens)."""
    from sgrpo.model.packing import sequence_lengths

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13], [1, 2, 3, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    completion = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0]]).bool()
    keep, counts = sequence_lengths(mask, completion)
    assert counts.tolist() == [5, 5, 0] and not keep[2].any()
    alone = pack_shared(ids[:2], mask[:2], completion[:2], None)
    with_empty = pack_shared(ids, mask, completion, None)
    assert torch.equal(with_empty.input_ids, alone.input_ids) and torch.equal(with_empty.segment, alone.segment)
