"""Policy-loss pieces against hand-computed numbers, and the chunked log-prob path against full logits."""

from __future__ import annotations

import math

import pytest
import torch

from sgrpo.model.head import TokenLogprobs
from sgrpo.model.logprobs import completion_logprobs, position_ids_from_mask
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.train.loss import clipped_surrogate, k3_kl, token_weights


def test_clipped_surrogate_hand_values():
    # ratios e^0.5 = 1.6487 (A = +1 -> clipped at 1.28 above), e^-0.5 = 0.6065 (A = -1 -> clipped at 0.8 below)
    logp = torch.tensor([[0.5, -0.5, 0.1]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([1.0])
    loss, low, high = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A = +1: -min(r, clip(r)) -> -1.28, -0.6065 (no clip below for A > 0: min picks r), -1.1052
    assert loss.tolist()[0] == pytest.approx([-1.28, -math.exp(-0.5), -math.exp(0.1)], rel=1e-6)
    assert high.tolist() == [[True, False, False]] and low.tolist() == [[False, False, False]]
    loss, low, high = clipped_surrogate(logp, old, -adv, clip_low=0.2, clip_high=0.28)
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)) -> 1.6487, 0.8, 1.1052
    assert loss.tolist()[0] == pytest.approx([math.exp(0.5), 0.8, math.exp(0.1)], rel=1e-6)
    assert low.tolist() == [[False, True, False]] and high.tolist() == [[False, False, False]]


def test_k3_kl_hand_values_and_sign():
    logp = torch.tensor([0.0, -1.0, -2.0])
    ref = torch.tensor([0.0, -2.0, -1.0])
    # d = ref - logp = 0, -1, 1 -> e^d - d - 1 = 0, e^-1 = 0.36788, e - 2 = 0.71828
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.0, math.exp(-1), math.e - 2], rel=1e-6)
    assert torch.all(k3_kl(torch.randn(100), torch.randn(100)) >= 0)


def test_token_weights_per_mode():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # |o| = 3 and 1
    # token mean over 4 tokens: 1/4 each
    assert token_weights(mask, "token_mean", 2, 4, 8).sum().item() == pytest.approx(1.0)
    # seq mean token mean: row 0 tokens 1/(2*3), row 1 token 1/(2*1)
    w = token_weights(mask, "seq_mean_token_mean", 2, 4, 8)
    assert w[0, 0].item() == pytest.approx(1 / 6) and w[1, 0].item() == pytest.approx(0.5)
    # seq sum const: 1 / (B * L_max) = 1/16 for every real token
    w = token_weights(mask, "seq_sum_const", 2, 4, 8)
    assert w[mask].tolist() == pytest.approx([1 / 16] * 4) and w[~mask].sum() == 0
    with pytest.raises(ValueError, match="aggregation"):
        token_weights(mask, "sum", 2, 4, 8)


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_logprobs_match_full_logits_and_padding_is_invisible(chunk):
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, seed=1)
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 9))
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # left padding on row 1
    ids = ids.masked_fill(attn == 0, tok.pad_token_id)
    cmask = torch.ones(3, 4, dtype=torch.bool)
    cmask[2, 2:] = False
    logp, entropy = completion_logprobs(model, ids, attn, cmask, temperature=0.7, chunk_size=chunk, with_entropy=True)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    full = (logits[:, -5:-1].float() / 0.7).log_softmax(-1)
    want = full.gather(-1, ids[:, -4:].unsqueeze(-1)).squeeze(-1) * cmask
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
    want_entropy = -(full.exp() * full).sum(-1) * cmask
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
    # the padded row scores its tokens as if it had no padding at all
    alone, _ = completion_logprobs(model, ids[1:2, 3:], attn[1:2, 3:], cmask[1:2], temperature=0.7)
    torch.testing.assert_close(alone, logp[1:2], atol=1e-5, rtol=1e-5)
    # gradients flow through the checkpointed chunks and match the full-logits path
    logp.sum().backward()
    got = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    full = (logits[:, -5:-1].float() / 0.7).log_softmax(-1)
    (full.gather(-1, ids[:, -4:].unsqueeze(-1)).squeeze(-1) * cmask).sum().backward()
    torch.testing.assert_close(got, model.lm_head.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompts_give_the_full_forwards_logprobs_and_gradients(checkpointing):
    """Rows repeating a prompt (3 prompts x 3 rows, left-padded, ragged completions): running each prompt
    once and its completions on its KV cache gives the full forward's log-probs and parameter gradients
    (with HF gradient checkpointing on, the function falls back to the full forward)."""
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, seed=2)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tok), (3, 5), generator=g)
    prompt_mask = torch.ones(3, 5, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[2, :4] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, tok.pad_token_id)
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    completions = torch.randint(3, len(tok), (9, 6), generator=g)
    cmask = torch.arange(6).unsqueeze(0) < torch.tensor([6, 2, 4, 1, 6, 3, 5, 6, 2]).unsqueeze(-1)
    ids = torch.cat([prompts[rows], completions.masked_fill(~cmask, tok.pad_token_id)], 1)
    attn = torch.cat([prompt_mask[rows], cmask.long()], 1)
    weights = torch.randn(9, 6, generator=g)
    results, batch_sizes = [], []
    model.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    for share in (False, True):
        model.zero_grad()
        batch_sizes.clear()
        logp, _ = completion_logprobs(model, ids, attn, cmask, temperature=0.9, share_prompts=share)
        assert batch_sizes == ([3, 9] if share and not checkpointing else [9])  # 3 distinct prompts run once
        (logp * weights).sum().backward()
        results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (logp_full, grad_full), (logp_shared, grad_shared) = results
    torch.testing.assert_close(logp_shared, logp_full, atol=1e-5, rtol=1e-5)
    assert (logp_full[~cmask] == 0).all()
    assert float((grad_shared - grad_full).norm() / grad_full.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_function_matches_autograd_of_full_logits(dtype):
    """TokenLogprobs (chunked, hand-written backward) against log_softmax autograd: values, entropy, and the
    gradients of hidden states, weight and bias, at temperature 0.8, with uneven chunks."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 8, generator=g).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(37, 8, generator=g)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(37, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, 37, (11,), generator=g)
    upstream = torch.randn(11, generator=g)
    logp, entropy = TokenLogprobs.apply(h, weight, bias, targets, 0.8, 4, True)
    (logp * upstream).sum().backward()
    got = [x.grad.clone() for x in (h, weight, bias)]
    for x in (h, weight, bias):
        x.grad = None
    full = ((h.float() @ weight.float().t() + bias.float()) / 0.8).log_softmax(-1)
    want = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * upstream).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(logp, want.detach(), **tol)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), **tol)
    for a, b in zip(got, (h.grad, weight.grad, bias.grad)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert not entropy.requires_grad
