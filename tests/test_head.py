"""The LM head's compute dtype: half-precision operands with float32 accumulation under mixed precision, the
float32 matmul unchanged at 32-true, and the chunked backward against autograd in both."""

from __future__ import annotations

import pytest
import torch

from sgrpo.head import LMHead, LogitTransform, TokenLogprobs, head_dtype


def _head(vocab: int = 37, hidden: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, hidden, generator=g)
    weight = (0.5 * torch.randn(vocab, hidden, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(vocab, generator=g)).to(dtype)
    return h, weight, bias


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def test_head_runs_in_autocasts_dtype_with_float32_accumulation():
    """Under bf16 autocast (bf16-mixed: float32 master weights) the head multiplies bf16-rounded h and W and
    accumulates in float32: its float32 logits are those of the rounded operands (bias added in float32), not
    the float32 head's (which bf16-mixed ran before, at fp32 matmul speed). Outside autocast (32-true) the
    head is the plain float32 matmul, bit for bit; with bf16 weights (bf16-true) it is bf16 again."""
    h, weight, bias = _head(vocab=300, hidden=64)
    exact = torch.mm(h, weight.t()) + bias
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = LMHead(weight, bias)
        assert head.dtype == torch.bfloat16 and head_dtype(weight) == torch.bfloat16
        got = head(h, temperature=0.5)
    assert got.dtype == torch.float32
    want = (_rounded(h, torch.bfloat16) @ _rounded(weight, torch.bfloat16).t() + bias) / 0.5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float((got - exact / 0.5).abs().max()) > 1e-3  # the rounding is really there

    head = LMHead(weight, bias)  # no autocast: float32, the same tensor as before, the same matmul
    assert head.dtype == torch.float32 and head.weight is weight
    assert torch.equal(head(h), exact)
    assert head_dtype(weight.bfloat16()) == torch.bfloat16
    half = LMHead(weight.bfloat16(), bias.bfloat16())(h)
    want = _rounded(h, torch.bfloat16) @ _rounded(weight, torch.bfloat16).t() + _rounded(bias, torch.bfloat16)
    torch.testing.assert_close(half, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)])
def test_token_logprobs_in_bf16_compute_match_autograd_of_the_rounded_head(transform):
    """TokenLogprobs with float32 weights in bf16 compute (bf16-mixed): log-probs and entropy equal the float32
    log-softmax of the bf16-rounded operands' logits; the hand-written backward's gradients of h, W and b
    (float32, the weights' dtype) equal autograd's through that computation to bf16 rounding of the upstream
    d logits (the backward's matmuls take bf16 operands, as autocast's do), with uneven chunks."""
    h, weight, bias = _head()
    h, weight, bias = (x.clone().requires_grad_() for x in (h, weight, bias))
    targets = torch.randint(0, 37, (11,), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(11, generator=torch.Generator().manual_seed(2))
    logp, entropy = TokenLogprobs.apply(h, weight, bias, targets, 0.8, 4, True, transform, torch.bfloat16)
    (logp * upstream).sum().backward()
    got = [x.grad.clone() for x in (h, weight, bias)]
    for x in (h, weight, bias):
        x.grad = None
    raw = transform.scale * (_rounded(h, torch.bfloat16) @ _rounded(weight, torch.bfloat16).t() + bias)
    if transform.softcap is not None:
        raw = transform.softcap * torch.tanh(raw / transform.softcap)
    full = (raw / 0.8).log_softmax(-1)
    want = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(got, (h.grad, weight.grad, bias.grad)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-2 * float(b.abs().max()), rtol=1e-2)
    # against the float32 head the log-probs differ by the operands' rounding
    exact = ((h @ weight.t() + bias) * transform.scale).detach()
    if transform.softcap is not None:
        exact = transform.softcap * torch.tanh(exact / transform.softcap)
    exact = (exact / 0.8).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert float((logp.detach() - exact).abs().max()) > 1e-4
