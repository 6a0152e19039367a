"""Packed log-probs (sgrpo.model.packing): the layout by hand, equality with the padded path, no KV cache and no
cross-sequence attention, the start-of-run check, and a tiny fit with packing on and off."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sgrpo.model.logprobs import completion_logprobs, final_hidden_states, packing_problem
from sgrpo.model.packing import layout_tokens, pack
from sgrpo.model.rows import first_fit, layout_cost, row_width
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, TokenBatch

TOKENIZER = build_char_tokenizer()


def tiny(attention: str = "sdpa", dtype: torch.dtype = torch.float32):
    model = build_tiny_llama(TOKENIZER, num_layers=2).to(dtype)
    model.config._attn_implementation = attention
    return model


def ragged_batch(n: int = 8, p: int = 7, t: int = 9, seed: int = 0):
    """Rows of left-padded prompts (1..p tokens) and right-padded completions (1..t tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 17, (n, p + t), generator=g)
    attention = torch.ones_like(ids)
    completion = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n):
        prompt = int(torch.randint(1, p + 1, (1,), generator=g))
        length = int(torch.randint(1, t + 1, (1,), generator=g))
        attention[i, : p - prompt] = 0
        attention[i, p + length :] = 0
        ids[attention == 0] = 0
        completion[i, :length] = True
    return ids, attention, completion


def test_pack_lays_out_a_small_batch_by_hand():
    # row 0: prompt [5, 6], completion [7, 8] (trained) -> runs 5 6 7 (3 tokens); row 1: prompt [9], completion [4]
    # (trained), then padding -> runs 9 (1 token); row 2: prompt [3, 4, 5], completion [6, 7] -> runs 3 4 5 6
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [0, 0, 9, 4, 0, 0], [3, 4, 5, 6, 7, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    completion = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    packed = pack(ids, attention, completion)  # rows of width 5 (the padded forward's), first fit by length
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 9], [5, 6, 7, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]  # tail padding: a sequence of its own
    # predictors of the trained tokens, row-major over the completion mask: row 0's 7 and 8 (from 6 and 7), row 1's
    # 4 (from 9), row 2's 6 and 7 (from 5 and 6)
    assert packed.hidden_index.tolist() == [5 + 1, 5 + 2, 4, 2, 3]
    assert packed.tokens == 8
    assert layout_tokens(attention, completion) == (8, 15, 10)
    assert first_fit([3, 1, 4], 5) == [(1, 0), (0, 4), (0, 0)]


def test_row_width_weighs_linear_against_quadratic_cost():
    """Cost rows x C x (1 + C / 6H), each capacity on the 2^(1/8) grid above W taken at its fullest row (hand-computed,
    W = 6): with a large H rows that drop padding win, with a small H narrow rows (less attention) do."""
    lengths = [6, 3, 3, 2]  # 14 tokens
    # W: [6], [3, 3], [2] -> 3 x 6 = 18; capacity 7 the same rows; 8: [6, 2], [3, 3] -> 2 x 8 = 16; 9 and 10: [6, 3],
    # [3, 2] -> 2 x 9; 11: [6, 3, 2], [3] -> 2 x 11; 12 and 13: [6, 3, 3], [2] -> 2 x 12; 14: one row, 14
    assert row_width(lengths, 6, 10_000) == 14  # 14 x (1 + 14 / 6e4) < 16 x (1 + 8 / 6e4) < 18 x (1 + 6 / 6e4)
    assert row_width(lengths, 6, 2) == 8  # 16 x (1 + 8 / 12) = 26.7 < 18 x 1.5 = 27 < 14 x (1 + 14 / 12) = 30.3
    assert row_width(lengths, 6, 1) == 6  # 18 x 2 = 36 < 16 x (1 + 8 / 6) = 37.3 < 14 x (1 + 14 / 6) = 46.7
    assert row_width(lengths, 6, None) == 6
    # every row one sequence of 5: capacities 7 to 9 keep those rows, taken at their fill (5, below W), no padding
    assert row_width([5] * 6, 6, 1) == 5  # 6 x 5 x (1 + 5 / 6) = 55 < W's 6 x 6 x 2 = 72; 10: 3 x 10 x (8 / 3) = 80
    assert row_width([5] * 6, 6, 10**6) == 5  # 30 slots as six rows of 5 or one of 30: the C term picks 5
    # 12: [6, 5], [5, 5, 2] -> 2 x 12 = 24 slots; 23: one row of every token, 23 slots, and 23 x (1 + 23 / 6e4) less
    assert row_width([6, 5, 5, 5, 2], 6, 10_000) == 23
    assert row_width([4] * 6, 6, 10**6) == 4  # six rows of 4: 24 slots like one row of 24, and the least C term


def test_row_width_costs_no_more_than_w_or_any_doubling_of_it():
    """The chosen width's modelled cost (``layout_cost``) is at most that of W and of every capacity W x 2^k up to one
    row, on random lengths, pads and hidden sizes (a 2^(1/8) grid alone missed the doublings: seeds 3 and 23)."""
    for seed in range(600):
        rng = random.Random(seed)
        lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 40))]
        w, h = max(lengths) + rng.randint(0, 50), rng.choice([4, 64, 256, 4096])
        doublings = [w * 2**k for k in range(12) if k == 0 or w * 2 ** (k - 1) < sum(lengths)]
        best = min(layout_cost(lengths, c, h) for c in doublings)
        assert layout_cost(lengths, row_width(lengths, w, h), h) <= best + 1e-9, seed


@pytest.mark.parametrize(
    ("attention", "dtype", "exact"),
    [("eager", torch.float32, True), ("sdpa", torch.float64, True), ("sdpa", torch.float32, False)],
)
def test_packed_forward_equals_the_padded_one(attention, dtype, exact):
    """Rows of the padded forward's width: bit-identical hidden states (eager fp32, SDPA fp64), within 1e-6 (SDPA
    fp32); and completion_logprobs with packing (the cost model's rows) within 1e-6 of the padded path, entropies
    too."""
    model = tiny(attention, dtype).eval()
    for seed in range(3):
        ids, mask, completion = ragged_batch(seed=seed)
        t = completion.shape[1]
        with torch.no_grad():
            padded = final_hidden_states(model, ids[:, :-1], mask[:, :-1])[:, -t:][completion]
            packed = pack(ids, mask, completion)
            rows = final_hidden_states(model, packed.input_ids, None, position_ids=packed.position_ids)
            rows = rows.reshape(-1, rows.shape[-1])[packed.hidden_index]
            if exact:
                assert torch.equal(rows, padded)
            torch.testing.assert_close(rows, padded, rtol=0, atol=1e-6)
            a, ea = completion_logprobs(model, ids, mask, completion, 0.7, with_entropy=True, share_prompts=False)
            b, eb = completion_logprobs(model, ids, mask, completion, 0.7, with_entropy=True, packing=True)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        torch.testing.assert_close(eb, ea, rtol=0, atol=1e-6)
        assert torch.equal(b == 0, ~completion)  # zero exactly off the completion mask


def test_packed_path_has_no_nan_where_eager_fp64_padding_has():
    """Eager attention in fp64: a left-padded row's padding queries see no key (-inf + min-float overflows), their
    NaN values reach real tokens through 0 x NaN; the packed rows hold no such query."""
    model = tiny("eager", torch.float64).eval()
    ids, mask, completion = ragged_batch()
    with torch.no_grad():
        padded, _ = completion_logprobs(model, ids, mask, completion, share_prompts=False)
        packed, _ = completion_logprobs(model, ids, mask, completion, packing=True)
        alone = [completion_logprobs(model, ids[i : i + 1, mask[i] > 0], mask[i : i + 1, mask[i] > 0],
                                     completion[i : i + 1, : int(completion[i].sum())])[0] for i in range(len(ids))]
    assert padded.isnan().any()  # the trap this guards against (if transformers fixes it, this line goes)
    assert torch.isfinite(packed).all()
    for i, row in enumerate(alone):
        torch.testing.assert_close(packed[i, : row.shape[1]], row[0], rtol=0, atol=1e-6)  # float32 logits


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_const"])
def test_packed_gradients_equal_the_padded_ones(aggregation):
    """Parameter gradients of the clipped surrogate with KL, for each loss aggregation: within 1e-6 relative."""
    ids, mask, completion = ragged_batch(n=6, seed=4)
    advantages = torch.linspace(-1, 1, 6)
    grads = []
    for packing in (False, True):
        model = tiny("sdpa")
        logp, _ = completion_logprobs(model, ids, mask, completion, packing=packing, share_prompts=False)
        loss_fn = ClippedSurrogate(aggregation=aggregation, kl_coef=0.1)
        old, ref = logp.detach() - 0.05 * completion, logp.detach() + 0.1 * completion
        loss, _ = loss_fn(TokenBatch(logp, old, advantages, completion, ref, None), BatchCounts(6, completion.sum(), 9))
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-6


def test_packed_path_builds_no_cache_and_keeps_sequences_apart(monkeypatch):
    """No DynamicCache is made (with use_cache on, transformers would skip its packed mask), and changing one
    sequence's tokens leaves every other sequence's log-probs unchanged bit for bit, whichever row it shares."""
    from transformers import cache_utils

    made = []
    original = cache_utils.DynamicCache.__init__
    counting = lambda self, *a, **k: made.append(1) or original(self, *a, **k)  # noqa: E731
    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counting)
    model = tiny("sdpa").eval()
    ids, mask, completion = ragged_batch(n=8, seed=1)
    packed = pack(ids, mask, completion, hidden_size=model.config.hidden_size)
    assert (packed.position_ids == 0).sum(-1).max() > 1  # some row holds several sequences
    with torch.no_grad():
        base, _ = completion_logprobs(model, ids, mask, completion, packing=True)
        for i in range(len(ids)):
            changed = ids.clone()
            changed[i] = torch.where(mask[i] > 0, (ids[i] - 3 + 1) % 14 + 3, ids[i])
            other, _ = completion_logprobs(model, changed, mask, completion, packing=True)
            keep = torch.arange(len(ids)) != i
            assert torch.equal(other[keep], base[keep])
            assert not torch.equal(other[i], base[i])
    assert made == []


def test_packing_problem_passes_good_models_and_names_bad_ones(monkeypatch):
    for attention in ("eager", "sdpa"):
        assert packing_problem(tiny(attention)) is None
    model = tiny("sdpa")
    model.config._attn_implementation = "my_custom_kernel"
    assert "'my_custom_kernel' cannot keep packed sequences apart" in packing_problem(model)

    def leaky(model, input_ids, attention_mask, cache=None, position_ids=None):  # a cache: no packed mask
        captured = []
        handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        handle.remove()
        return captured[-1]

    import sgrpo.model.logprobs as logprobs

    monkeypatch.setattr(logprobs, "final_hidden_states", leaky)
    assert "change with another's tokens" in packing_problem(tiny("sdpa"))


def test_packing_problem_catches_wrong_positions(monkeypatch):
    """Packed rows whose position ids are lost (all 0) fail the comparison with the unpadded sequences."""
    import sgrpo.model.logprobs as logprobs

    original = logprobs.final_hidden_states

    def lost_positions(model, input_ids, attention_mask, cache=None, position_ids=None):
        if attention_mask is None:  # the packed call
            position_ids = torch.zeros_like(position_ids)
        return original(model, input_ids, attention_mask, cache, position_ids)

    model = tiny("sdpa")
    with torch.no_grad():  # sharp attention (a random tiny model's is near uniform, whatever the positions)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 30
            layer.self_attn.k_proj.weight *= 30
    assert packing_problem(model) is None
    monkeypatch.setattr(logprobs, "final_hidden_states", lost_positions)
    assert "differ from unpadded ones by" in packing_problem(model)


def _fit_rows(root, *extra):
    import csv
    from pathlib import Path

    from sgrpo.fit import main

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    main(["--config", str(config), f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
          "--trainer.enable_model_summary=false", *extra])
    rows = []
    for path in sorted(Path(root).glob("lightning_logs/version_*/metrics.csv")):
        with open(path) as f:
            rows += [r for r in csv.DictReader(f) if r.get("train/reward")]
    return rows


@pytest.mark.slow
def test_tiny_fit_logs_the_same_with_and_without_packing(tmp_path):
    """configs/tiny.yaml for 10 steps, packing and the lean MLP on (the defaults) and both off: every logged value
    within 1e-5 relative, except timings, the layout's own metrics, and the sampler-trainer gap (float noise around
    1e-7 either way, atol 1e-5)."""
    on = _fit_rows(tmp_path / "on", "--model.packing=true")
    off = _fit_rows(tmp_path / "off", "--model.packing=false", "--model.lean_mlp=false")
    assert len(on) == len(off) == 10
    layout = ("padding_fraction", "tokens_per_micro_batch", "token_imbalance", "time/", "throughput/")
    for a, b in zip(on, off):
        assert a.keys() == b.keys()
        for key in a:
            if not a[key] or any(part in key for part in layout):
                continue
            atol = 1e-5 if "mismatch" in key else 0.0
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=atol), key
    assert any(float(a["train/padding_fraction"]) < float(a["train/padding_fraction_padded"]) for a in on)
    assert all(a["train/padding_fraction"] == a["train/padding_fraction_padded"] for a in off)


@pytest.mark.slow
def test_a_model_that_cannot_pack_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    import sgrpo.train.micro_logprobs as micro_logprobs

    monkeypatch.setattr(micro_logprobs, "packing_problem", lambda model: "attention implementation 'x' cannot keep ...")
    with caplog.at_level(logging.WARNING, logger="sgrpo.train.update"):
        rows = _fit_rows(tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=3")
    warnings = [r.getMessage() for r in caplog.records if "model.packing" in r.getMessage()]
    assert warnings == ["model.packing: falling back to padded log-probs: attention implementation 'x' cannot keep ..."]
    assert all(r["train/padding_fraction"] == r["train/padding_fraction_padded"] for r in rows)


def test_balanced_bins_by_hand():
    from sgrpo.train.batching import balanced_bins, bins_needed, sequence_cost

    assert sequence_cost(12, 2) == 12 + 144 / 12 and sequence_cost(12, None) == 12
    # costliest first to the cheapest bin: 9 -> b0, 7 -> b1, 6 -> b1 (7 < 9), 5 -> b0 (9 < 13), 4 -> b1 (13 < 14),
    # 3 -> b0 (14 < 17): loads 17 and 17
    assert balanced_bins([5, 9, 3, 7, 6, 4], 2) == [[1, 0, 2], [3, 4, 5]]
    assert balanced_bins([5, 9, 3, 7], 3) == [[1], [3], [0, 2]]  # 9 | 7 | 5, then 3 to the 5
    assert balanced_bins([5, 9, 3, 7], 2, max_rows=2) == [[1, 2], [3, 0]]  # 9 | 7, 5 -> b1 (7), 3 -> b0: b1 is full
    assert bins_needed([], 10, None) == 0
    assert bins_needed([5, 9, 3, 7, 6, 4], None, None) == 1
    assert bins_needed([5, 9, 3, 7, 6, 4], 17, None) == 2  # 34 / 17 = 2, and LPT reaches 17 + 17
    assert bins_needed([5, 9, 3, 7, 6, 4], None, 4) == 2
    assert bins_needed([30, 1, 1], 10, None) == 2  # 30 over budget goes alone, 1 + 1 in one bin
    assert bins_needed([6, 6, 6], 10, None) == 3  # 18 / 10 -> 2 bins, but LPT's 12 is over: 3


def test_packing_with_lora_and_under_bf16_autocast():
    """LoRA adapters (B initialised away from 0 so they act): packed log-probs and adapter gradients equal the
    padded ones (1e-6); under CPU bf16 autocast the start-of-run check passes (its perturbation test is exact)."""
    from sgrpo.model.lora import LoRA, apply_lora

    ids, mask, completion = ragged_batch(n=6, seed=2)
    results = []
    for packing in (False, True):
        model = tiny("sdpa")
        apply_lora(model, LoRA(rank=4, dropout=0.0))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
        logp, _ = completion_logprobs(model, ids, mask, completion, packing=packing, share_prompts=False)
        (logp * torch.linspace(-1, 1, 6)[:, None]).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
        results.append((logp.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-6)
    assert results[0][1].norm() > 0
    assert float((results[1][1] - results[0][1]).norm() / results[0][1].norm()) < 1e-6
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packing_problem(tiny("sdpa")) is None


def test_layout_logs_with_a_reduce_that_works_in_place():
    """Lightning's DDP/FSDP2 ``strategy.reduce`` all-reduces the tensor it is given in place: the maximum must not
    overwrite the sums (it read the other process's maximum once). The layout metrics are over every process (each
    process's own ratio, averaged over processes, weighed them unequally). Here the other process ran 300 tokens,
    150 of them real, in 2 micro-batches (400 padded)."""
    from types import SimpleNamespace

    from sgrpo.train.update import LAYOUT, PolicyUpdate

    def reduce(tensor, reduce_op):
        other = torch.tensor([150.0, 400.0, 300.0, 2.0, 1.0]) if tensor.dim() else torch.tensor(300.0)
        tensor.copy_(torch.maximum(tensor, other) if reduce_op == "max" else tensor + other)
        return tensor

    policy = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace(reduce=reduce)))
    sums = dict(zip(LAYOUT, map(torch.tensor, (90.0, 150.0, 100.0, 2.0))))
    logs = PolicyUpdate._layout_logs(policy, sums)
    assert float(logs["train/padding_fraction"]) == pytest.approx(160 / 400)  # (400 - 240) / 400
    assert float(logs["train/padding_fraction_padded"]) == pytest.approx(310 / 550)  # (550 - 240) / 550
    assert float(logs["train/tokens_per_micro_batch"]) == 60.0  # 240 / 4
    assert float(logs["train/update/token_imbalance"]) == pytest.approx(300 / 200)


def test_a_sharing_probe_that_raises_packs_without_sharing(monkeypatch, caplog):
    """The block mask's first use is the sharing probe (flex attention's ``create_block_mask``, SDPA's additive mask):
    a kernel that refused it used to end the run at its first update. Now: packed rows, each with its own prompt
    copy, and one warning naming the error."""
    import logging

    import sgrpo.model.packed_path as packed_path
    from tests.test_packing_shared import tiny, verdict_of

    def refuse(model):
        raise RuntimeError("flex_attention: the kernel refused the BlockMask")

    monkeypatch.setattr(packed_path, "shared_packing_problem", refuse)
    with caplog.at_level(logging.WARNING, logger="sgrpo.train.update"):
        assert verdict_of(tiny("sdpa")) == (True, False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("model.share_prompts: packed rows hold each completion's own prompt copy: the check raised "
                    "RuntimeError: flex_attention: the kernel refused the BlockMask")


def test_a_row_limit_keeps_a_groups_rows_together_in_parts_of_at_most_that_many():
    """With ``micro_batch_size`` each row was placed on its own: one group's 8 rows spread over every micro-batch and
    its prompt ran in each. Now a group's rows come in parts of at most ``max_rows``, each its prompt once, and every
    micro-batch holds at most ``max_rows`` rows."""
    from sgrpo.train.batching import update_micro_batches
    from sgrpo.types import RolloutBatch

    groups, g, p, t = 4, 8, 6, 5
    prompts = torch.randint(3, 17, (groups, p), generator=torch.Generator().manual_seed(0)).repeat_interleave(g, 0)
    ids = torch.cat([prompts, torch.randint(3, 17, (groups * g, t), generator=torch.Generator().manual_seed(1))], 1)
    completion = torch.arange(t).unsqueeze(0) < torch.randint(1, t + 1, (groups * g, 1))
    attention = torch.cat([torch.ones(groups * g, p, dtype=torch.long), completion.long()], 1)
    truncated = torch.zeros(groups * g, dtype=torch.bool)
    rollout = RolloutBatch(ids, attention, completion, [""] * (groups * g), truncated, g)
    rows = torch.arange(groups * g)
    for max_rows in (4, 8, 3):
        chunks = update_micro_batches(rollout, rows, completion, True, 64, max_rows, None, share=True)
        assert sorted(torch.cat(chunks).tolist()) == rows.tolist() and max(len(c) for c in chunks) <= max_rows
        prompts_run = sum(len(set((c // g).tolist())) for c in chunks)  # each group's prompt, once per chunk it is in
        assert prompts_run == groups * -(-g // max_rows), (max_rows, [c.tolist() for c in chunks])
