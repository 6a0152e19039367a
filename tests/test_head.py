"""The LM head's compute dtype: half-precision operands with float32 accumulation under mixed precision, the
float32 matmul unchanged at 32-true, and the chunked backward against autograd in both."""

from __future__ import annotations

import pytest
import torch

from sgrpo.model.head import LMHead, LogitTransform, TokenLogprobs, head_dtype


def _head(vocab: int = 37, hidden: int = 8, dtype=torch.float32, tokens: int = 11):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g)
    weight = (0.5 * torch.randn(vocab, hidden, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(vocab, generator=g)).to(dtype)
    return h, weight, bias


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype``, in float32; the gradient passes through unrounded (as the head's does)."""
    return x + (x.detach().to(dtype).float() - x.detach())


def test_head_runs_in_autocasts_dtype_with_float32_accumulation():
    """Under bf16 autocast (bf16-mixed: float32 master weights) the head multiplies the bf16-rounded W with h
    kept (on CPU exactly; in two bf16 parts where the device has a bf16 matmul with a float32 result) and
    accumulates in float32: its float32 logits are those of h and the rounded W (bias in float32), not the
    float32 head's (which bf16-mixed ran before, at fp32 matmul speed). Outside autocast (32-true) the head
    is the plain float32 matmul, bit for bit; with bf16 weights (bf16-true) it is bf16 again."""
    h, weight, bias = _head(vocab=300, hidden=64)
    exact = torch.mm(h, weight.t()) + bias
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head = LMHead(weight, bias)
        assert head.dtype == torch.bfloat16 and head_dtype(weight) == torch.bfloat16
        got = head(h, temperature=0.5)
    assert got.dtype == torch.float32
    want = (h @ _rounded(weight, torch.bfloat16).t() + bias) / 0.5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float((got - exact / 0.5).abs().max()) > 1e-3  # the rounding is really there

    head = LMHead(weight, bias)  # no autocast: float32, the same tensor as before, the same matmul
    assert head.dtype == torch.float32 and head.weight is weight
    assert torch.equal(head(h), exact)
    assert head_dtype(weight.bfloat16()) == torch.bfloat16
    half = LMHead(weight.bfloat16(), bias.bfloat16())(h.bfloat16())
    want = _rounded(h, torch.bfloat16) @ _rounded(weight, torch.bfloat16).t() + _rounded(bias, torch.bfloat16)
    torch.testing.assert_close(half, want, atol=1e-5, rtol=1e-5)


def _emulated_cuda_matmul(monkeypatch):
    """Run the head's CUDA branch on CPU: a bf16 x bf16 -> float32 matmul as cuBLAS computes it (products of
    bf16 values are exact in float32; float32 sums)."""
    import sgrpo.model.head

    monkeypatch.setattr(sgrpo.model.head, "_fp32_output", lambda device, dtype: True)

    def mm(a, b, out=None):
        assert a.dtype == b.dtype == torch.bfloat16  # the operands really are bf16
        return torch.mm(a.float(), b.float(), out=out)

    monkeypatch.setattr(sgrpo.model.head, "_mm_fp32", mm)


def test_two_bf16_parts_keep_the_head_continuous_in_h(monkeypatch):
    """On the bf16 matmul (CUDA's branch, emulated), h goes in as hi + lo bf16 parts: the logits equal h's exact
    product with the rounded W to ~2^-16, and a tiny change of h (as between 1 and 2 processes) moves them by
    about as much. Rounded to one bf16 part, h would be a step function: a change of 1e-6 of h moved the logits
    by ~1e-3 where it crossed a rounding boundary, and a 2-process twin's loss drifted 4.5e-4 from 1 process's."""
    _emulated_cuda_matmul(monkeypatch)
    h, weight, bias = _head(vocab=300, hidden=64, tokens=1024)
    head = LMHead(weight, bias, dtype=torch.bfloat16)
    assert head.weight.dtype == torch.bfloat16
    exact = h @ _rounded(weight, torch.bfloat16).t() + bias
    torch.testing.assert_close(head(h), exact, atol=2e-4, rtol=0)
    nudged = h * (1 + 1e-6 * torch.randn(h.shape, generator=torch.Generator().manual_seed(3)))
    assert float((head(nudged) - head(h)).abs().max()) < 2e-4  # the exact product moves 1.5e-5
    one_part = (_rounded(nudged, torch.bfloat16) - _rounded(h, torch.bfloat16)) @ _rounded(weight, torch.bfloat16).t()
    assert float(one_part.abs().max()) > 1e-3  # what rounding h once did


@pytest.mark.parametrize("emulated_cuda", [False, True])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)])
def test_token_logprobs_in_bf16_compute_match_autograd_of_the_rounded_head(transform, emulated_cuda, monkeypatch):
    """TokenLogprobs with float32 weights in bf16 compute (bf16-mixed), on CPU's branch and on CUDA's (emulated):
    log-probs and entropy equal the float32 log-softmax of h times the bf16-rounded W; the hand-written
    backward's gradients of h, W and b (float32, the weights' dtype) equal autograd's through that
    computation, with uneven chunks."""
    if emulated_cuda:
        _emulated_cuda_matmul(monkeypatch)
    h, weight, bias = _head()
    h, weight, bias = (x.clone().requires_grad_() for x in (h, weight, bias))
    targets = torch.randint(0, 37, (11,), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(11, generator=torch.Generator().manual_seed(2))
    logp, entropy = TokenLogprobs.apply(h, weight, bias, targets, 0.8, 4, True, transform, torch.bfloat16)
    (logp * upstream).sum().backward()
    got = [x.grad.clone() for x in (h, weight, bias)]
    for x in (h, weight, bias):
        x.grad = None
    raw = transform.scale * (h @ _rounded(weight, torch.bfloat16).t() + bias)
    if transform.softcap is not None:
        raw = transform.softcap * torch.tanh(raw / transform.softcap)
    full = (raw / 0.8).log_softmax(-1)
    want = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(got, (h.grad, weight.grad, bias.grad)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=1e-4)
    # against the float32 head the log-probs differ by the weight's rounding
    exact = ((h @ weight.t() + bias) * transform.scale).detach()
    if transform.softcap is not None:
        exact = transform.softcap * torch.tanh(exact / transform.softcap)
    exact = (exact / 0.8).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert float((logp.detach() - exact).abs().max()) > 1e-4


def test_real_fp32_output_matmuls_stack_the_parts_along_the_inner_dimension_on_meta(monkeypatch):
    """The real ``torch.mm(..., out_dtype=torch.float32)`` / ``torch.addmm`` calls of the bf16 head, run on the meta
    device (CUDA's branch: meta has the kernels' shape and dtype rules): the forward's two parts of h go in as one
    GEMM of inner size 2H writing the ``[chunk, V]`` logits once (no ``[2 chunk, V]`` float32 temporary); the
    backward's grad_h is one GEMM of inner size 2V, and grad_W accumulates in place (beta = 1) in two GEMMs, never
    writing a ``[V, H]`` float32 product per chunk; the backward's only vocabulary-sized memory is the logits buffer
    and each chunk's two bf16 parts (``grads_in_parts_``)."""
    vocab, hidden, tokens, chunk = 40, 8, 10, 4
    h = torch.randn(tokens, hidden, device="meta", requires_grad=True)
    weight = torch.randn(vocab, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.zeros(tokens, dtype=torch.long, device="meta")
    from sgrpo.model.head import _fp32_accumulate, _fp32_output

    assert _fp32_output("meta", torch.bfloat16) and _fp32_accumulate("meta", torch.bfloat16)  # probed: the real calls
    calls, inside = [], []
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, b, *args, **kwargs):  # the head's calls (not those of the meta kernels' own decompositions)
        if not inside:
            calls.append(("mm", tuple(a.shape), tuple(b.shape), a.dtype, kwargs.get("out_dtype")))
        inside.append(1)
        try:
            return real_mm(a, b, *args, **kwargs)
        finally:
            inside.pop()

    def addmm(acc, a, b, *args, **kwargs):
        if not inside:
            calls.append(("addmm", tuple(a.shape), tuple(b.shape), a.dtype, kwargs.get("out_dtype")))
        inside.append(1)
        try:
            out = real_addmm(acc, a, b, *args, **kwargs)
        finally:
            inside.pop()
        assert out is acc  # accumulated in place
        return out

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    logp, _ = TokenLogprobs.apply(h, weight, None, targets, 1.0, chunk, False, None, torch.bfloat16)
    forward, calls[:] = list(calls), []
    bf16, f32 = torch.bfloat16, torch.float32
    rows = [4, 4, 2]
    assert forward == [("mm", (n, 2 * hidden), (2 * hidden, vocab), bf16, f32) for n in rows]
    with FreshVocabSized(vocab, hidden) as fresh:
        logp.sum().backward()
    for n in rows:  # per chunk: the logits again, grad_h, grad_W
        assert ("mm", (n, 2 * hidden), (2 * hidden, vocab), bf16, f32) in calls
        assert ("mm", (n, 2 * vocab), (2 * vocab, hidden), bf16, f32) in calls  # [dr_hi | dr_lo] @ [W; W]
        assert ("addmm", (vocab, 2 * n), (2 * n, hidden), bf16, f32) in calls  # hi hi + hi lo, into grad_W
        assert ("addmm", (vocab, n), (n, hidden), bf16, f32) in calls  # lo hi
    assert len(calls) == 4 * len(rows)
    assert h.grad.shape == h.shape and h.grad.dtype == f32 and weight.grad.dtype == bf16
    # vocabulary-sized memory: the reused logits buffer, then per chunk only dr's two bf16 parts (one float32 chunk
    # in all; the parts are stacked in dr's own storage); before, 3.5 to 4.5 chunks: a float32 copy and a difference
    # per split, split twice, and the stacked [2c, V] and [V, 3c] operands
    assert fresh.bytes == 4 * chunk * vocab + sum(2 * (2 * n * vocab) for n in rows), fresh.seen


class FreshVocabSized(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of each fresh tensor (not a view or an in-place result of an input) of ``[rows, vocab]``-like
    shape (a dimension of ``vocab`` or ``2 vocab``, none of ``hidden``: ``grad_W`` aside) that the ops under it
    return."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.bytes, self.seen = vocab, hidden, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        for t in out if isinstance(out, (tuple, list)) else [out]:
            sized = isinstance(t, torch.Tensor) and {self.vocab, 2 * self.vocab} & set(t.shape)
            if sized and not {self.hidden, 2 * self.hidden} & set(t.shape) and not t._is_view() and not any(
                t.untyped_storage()._cdata == a.untyped_storage()._cdata for a in inputs
            ):
                self.bytes += t.numel() * t.element_size()
                self.seen.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_a_backward_called_under_cpu_autocast_keeps_its_float32_products():
    """Lightning's manual_backward runs inside training_step's autocast (bf16-mixed); on CPU the backward runs on
    that thread, so its float32 products were cast to bf16: grad_h came out 2e-3 off the backward outside autocast
    (found by a review). Now both are equal."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = (0.1 * torch.randn(500, 32)).requires_grad_()
    targets, g = torch.randint(0, 500, (64,)), torch.randn(64)

    def grads(inside: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward under bf16-mixed
            logp, _ = TokenLogprobs.apply(h, w, None, targets, 1.0, 16, False, None, None)
            if inside:
                (logp * g).sum().backward()
        if not inside:
            (logp * g).sum().backward()
        return h.grad.clone(), w.grad.clone()

    (h_in, w_in), (h_out, w_out) = grads(True), grads(False)
    assert torch.equal(h_in, h_out) and torch.equal(w_in, w_out)
