"""The LM head, computed one way for sampling and for the loss: the compute dtype's operands, float32 logits.

Both the rollout's sampler and the policy loss turn a final hidden state ``h`` into logits here, so the
policy that samples is the policy that is trained:

* the matmul ``h W^T`` runs in the compute dtype (``head_dtype``: autocast's under bf16-mixed /
  16-mixed, else the weight's: float32 at 32-true, bf16 at bf16-true) with float32 accumulation and
  float32 logits: ``W`` rounded to it once (``head_operand``), ``h`` kept to 16 bits as two bf16 parts
  (``weight_mm``: matmuls with a float32 result, as cuBLAS has; on CPU, which has none, the same
  product in float32 with ``h`` exact); ``+ b`` in float32. The backward's matmuls likewise;
* the model's own output transform follows (``LogitTransform``: Gemma 2/3 final-logit soft-capping,
  Granite ``logits_scaling``, Cohere ``logit_scale``), then the sampling temperature.

At 32-true nothing is rounded: a float32 matmul, as before. A float64 model (a CPU test instrument: the precision
of a sampler's recorded log-probs) keeps float64 in the forward, logits included (``logits_dtype``), and in the
backward. ``check_logit_head`` compares this against the model's own forward when
the model loads, and refuses a model whose forward does something else to its logits.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LogitTransform:
    """``logits = c tanh(s raw / c)`` with ``raw = h W^T + b``, ``s = scale``, ``c = softcap`` (or ``s raw``).

    d logits / d raw = ``s (1 - (logits / c)^2)``.
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> LogitTransform:
        """The transform a transformers causal LM applies after its ``lm_head`` (read from its config)."""
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config

        def read(name: str):
            value = getattr(text, name, None)
            return getattr(config, name, None) if value is None else value

        scale = 1.0
        if read("logits_scaling") is not None:  # Granite: logits / logits_scaling
            scale /= float(read("logits_scaling"))
        if read("logit_scale") is not None:  # Cohere: logits * logit_scale
            scale *= float(read("logit_scale"))
        softcap = read("final_logit_softcapping")  # Gemma 2/3: c tanh(logits / c)
        return cls(scale, None if softcap is None else float(softcap))

    def apply_(self, z: Tensor) -> Tensor:
        """Transform raw logits ``z`` in place (float32) and return them."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits of a head computing in ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_dtype(weight: Tensor) -> torch.dtype:
    """The head's compute dtype: autocast's where autocast is on for ``weight``'s device (bf16-mixed,
    16-mixed: float32 master weights, half-precision matmuls), else ``weight``'s own."""
    device = weight.device.type
    if weight.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


@functools.cache
def _fp32_output(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` multiplies ``dtype`` operands into a float32 result on this device (CUDA: yes)."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def head_operand(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight ``x`` rounded to ``dtype``, held as ``weight_mm`` takes it: in ``dtype`` where the device
    multiplies it with a float32 result, else as float32 (the rounded values, exactly); float64 as it is."""
    x = x.to(dtype)
    if dtype in (torch.float32, torch.float64) or _fp32_output(x.device.type, dtype):
        return x
    return x.float()


def _parts(x: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """``x`` as ``hi + lo`` in ``dtype``: ``hi`` its rounding, ``lo`` the rounding of the rest (16 significant
    bits in all for bf16, 22 for float16; one part alone keeps 8 or 11); just ``[x]`` if ``x`` is in ``dtype``."""
    if x.dtype == dtype:
        return [x]
    hi = x.to(dtype)
    return [hi, (x.float() - hi.float()).to(dtype)]


def _mm_fp32(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` for half-precision operands, accumulated and returned in float32 (CUDA: one cuBLAS call)."""
    return torch.mm(a, b, out_dtype=torch.float32) if out is None else torch.mm(a, b, out_dtype=torch.float32, out=out)


@functools.cache
def _fp32_accumulate(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm`` adds the float32 product of ``dtype`` operands into a float32 tensor in place."""
    try:
        acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)  # not the default dtype: bf16 in bf16-true
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` for half-precision operands and a float32 ``acc``: one GEMM with beta = 1 where the
    device has it (CUDA), so no ``[n, p]`` float32 product is written and read back; else product, then add."""
    if _fp32_accumulate(acc.device.type, a.dtype):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(_mm_fp32(a, b))


def stacked_operand(weight: Tensor, dim: int) -> Tensor:
    """``weight`` twice along ``dim`` (``[W, W]``): the right operand of ``[hi, lo] @ [W; W] = hi W + lo W``."""
    return torch.cat([weight, weight], dim)


def weight_mm(x: Tensor, weight: Tensor, dtype: torch.dtype, out: Tensor | None = None,
              stacked: Tensor | None = None) -> Tensor:  # fmt: skip
    """float32 ``x @ weight`` for an activation ``x`` ``[m, k]`` and a ``head_operand`` ``weight`` ``[k, n]``.

    The weight is in the compute dtype; the activation is not rounded to it: where the device multiplies
    the compute dtype with a float32 result, ``x = hi + lo`` goes in as two parts (``_parts``) stacked along
    the inner dimension, ``[hi, lo] @ [W; W]``: one GEMM of inner size ``2k`` writing the ``[m, n]`` float32
    result once (``stacked``: ``[W; W]`` ``[2k, n]`` made once by the caller, else here). Elsewhere (CPU)
    ``x`` is multiplied exactly, in float32. Rounding ``x`` to one bf16 part is a step function of it: a
    difference ``d`` between two runs (1 and 2 processes) would come out of the head as about
    ``sqrt(d * 2^-8)`` instead of ``d``.
    """
    if weight.dtype in (torch.float32, torch.float64):  # float64: a float64 product (``logits_dtype``)
        return torch.mm(x.to(weight.dtype), weight, out=out)
    parts = _parts(x, dtype)
    if len(parts) == 1:
        return _mm_fp32(parts[0], weight, out=out)
    stacked = stacked_operand(weight, 0) if stacked is None else stacked  # [2k, n]
    return _mm_fp32(torch.cat(parts, 1), stacked, out=out)  # [m, 2k] @ [2k, n]: hi @ W + lo @ W


def activations_mm_(acc: Tensor, a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``acc += a @ b`` in float32 for two activations (float32, ``[n, k]`` and ``[k, p]``), in ``dtype``'s matmul.

    Where the device multiplies the compute dtype with a float32 result: ``hi hi + hi lo + lo hi``
    (``_parts``), one GEMM over the three stacked along ``k`` accumulating into ``acc`` (``_addmm_fp32_``);
    elsewhere one float32 matmul."""
    if dtype == torch.float32 or not _fp32_output(a.device.type, dtype):
        return acc.addmm_(a.float(), b.float())
    a_parts, b_parts = _parts(a, dtype), _parts(b, dtype)
    pairs = [(x, y) for i, x in enumerate(a_parts) for j, y in enumerate(b_parts) if i + j < 2]  # no lo lo
    return _addmm_fp32_(acc, torch.cat([x for x, _ in pairs], 1), torch.cat([y for _, y in pairs], 0))


def grads_in_parts_(z: Tensor, h: Tensor, head: LMHead, dtype: torch.dtype, grad_h: Tensor | None,
                    grad_w: Tensor | None) -> None:  # fmt: skip
    """The head's backward matmuls for one chunk on a device that multiplies ``dtype`` into float32 (CUDA):
    ``grad_h = dr W`` into ``grad_h`` and ``grad_W += dr^T h``, with ``dr`` = ``z`` (float32 ``[c, V]``) and ``h``
    in two ``dtype`` parts each, as ``weight_mm`` and ``activations_mm_`` compute them (``hi hi + hi lo + lo hi``
    for ``grad_W``), the parts written into ``z``'s own storage, which holds ``2 c V`` values of ``dtype``: ``[hi;
    hi]`` (or ``[hi; lo]``) as ``[2c, V]`` for ``grad_W``, then ``[hi | lo]`` as ``[c, 2V]`` for ``grad_h``. So a
    chunk's backward holds ``z`` and its two parts (two chunks of float32 in all), where stacking fresh copies
    held ``z``, a float32 copy and a difference per split, and the ``[V, 3c]`` stacked operand (3.5 to 4.5)."""
    rows, vocab = z.shape
    hi = z.to(dtype)
    lo = z.sub_(hi).to(dtype)  # z: the rest; from here its storage holds the parts
    parts = z.view(dtype)  # [c, 2V]
    if grad_w is not None:
        h_parts = _parts(h, dtype)
        stacked = parts.view(2 * rows, vocab)
        stacked[:rows], stacked[rows:] = hi, hi if len(h_parts) == 2 else lo
        _addmm_fp32_(grad_w, stacked.t(), torch.cat(h_parts if len(h_parts) == 2 else h_parts * 2, 0))
        if len(h_parts) == 2:  # lo hi, the third product
            _addmm_fp32_(grad_w, lo.t(), h_parts[0])
    if grad_h is not None:
        parts[:, :vocab], parts[:, vocab:] = hi, lo
        grad_h.copy_(_mm_fp32(parts, head.stacked(0)))  # [hi | lo] @ [W; W]


class LMHead:
    """An LM head ready to run: ``logits(h) = transform(h W^T + b) / T``, float32 ``[M, V]`` for ``h`` ``[M, H]``.

    ``weight`` is cast once (``head_operand``) to the compute dtype ``dtype`` (default ``head_dtype``:
    autocast's, else the weight's), so a decode loop pays the cast once per rollout, not per token;
    ``h`` is rounded to it at each call; ``b`` is added in float32. At float32 the weight is used as is.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, transform: LogitTransform | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        self.dtype = head_dtype(weight) if dtype is None else dtype
        self.weight, self.bias = head_operand(weight, self.dtype), bias
        self.transform = transform or LogitTransform()
        self._stacked: dict[int, Tensor] = {}  # [W, W] along a dimension, made on first use (two-part matmuls)

    def stacked(self, dim: int) -> Tensor | None:
        """``[W, W]`` along ``dim`` (``weight_mm``'s two-part operand), made once per head; None where unused."""
        if self.weight.dtype in (torch.float32, torch.float64):
            return None
        if dim not in self._stacked:
            self._stacked[dim] = stacked_operand(self.weight, dim)
        return self._stacked[dim]

    def refresh(self, other: LMHead) -> None:
        """Take ``other``'s weight (the same head, cast again after an update) into this head's tensors, in place:
        a CUDA graph captured with this head reads them at their addresses (``sgrpo.rollout.graphs``)."""
        if other.weight is not self.weight:
            self.weight.copy_(other.weight)
        for dim, stacked in self._stacked.items():
            stacked.copy_(stacked_operand(self.weight, dim))

    @classmethod
    def of(cls, model: nn.Module) -> LMHead:
        """``model``'s own LM head and output transform, in the compute dtype of the current autocast state."""
        head = model.get_output_embeddings()
        return cls(head.weight, head.bias, LogitTransform.of(model))

    def __call__(self, h: Tensor, temperature: float = 1.0, out: Tensor | None = None) -> Tensor:
        """float32 logits ``[M, V]``; ``out`` (float32 ``[M, V]``) is an optional reusable buffer."""
        # the meta device (CI's stand-in for CUDA's kernels) has no autocast, so none to turn off
        off = torch.autocast(h.device.type, enabled=False) if h.device.type != "meta" else contextlib.nullcontext()
        with off:
            stacked = self.stacked(1) if h.dtype != self.dtype else None  # [V, 2H]: its transpose is [W^T; W^T]
            z = weight_mm(h, self.weight.t(), self.dtype, out=out, stacked=None if stacked is None else stacked.t())
            if self.bias is not None:
                z.add_(self.bias)
        self.transform.apply_(z)
        return z.div_(temperature) if temperature != 1.0 else z


def model_head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """``LMHead.of(model)``: float32 ``[M, V]`` logits for ``hidden`` ``[M, H]``."""
    return LMHead.of(model)(hidden)


@torch.no_grad()
def check_logit_head(model: nn.Module, probe_tokens: int = 8) -> None:
    """Raise if ``model``'s forward turns its last hidden states into logits other than ``model_head_logits``.

    One short forward in eval mode; the logits of both must agree to float rounding of the head's dtype.
    """
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(min(probe_tokens, vocab), device=device).unsqueeze(0)  # [1, S]
    captured: list[Tensor] = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    was_training = model.training
    try:
        model.eval()
        theirs = model(input_ids=ids).logits[0].float()  # [S, V]
    finally:
        handle.remove()
        model.train(was_training)
    ours = model_head_logits(model, captured[-1][0])
    rounding = 1e-4 if head_dtype(model.get_output_embeddings().weight) == torch.float32 else 2e-2
    gap = float((ours - theirs).abs().max())
    if not gap <= rounding * max(1.0, float(theirs.abs().max())):  # NaN fails too
        name = type(model).__name__
        raise ValueError(
            f"{name}'s forward turns its hidden states into logits in a way sgrpo does not model (max "
            f"difference {gap:.3g} from lm_head with {LogitTransform.of(model)}); sgrpo applies "
            "final_logit_softcapping, logits_scaling and logit_scale. Training would use wrong log-probs: "
            "use another model, or add its transform to sgrpo.model.head.LogitTransform"
        )


class TokenLogprobs(torch.autograd.Function):
    """``log softmax(transform(h W^T + b) / T)[target]`` per token, chunk by chunk, never holding ``[M, vocab]``.

    Forward: for each chunk of ``chunk`` tokens, float32 logits ``z`` (``LMHead``, in compute dtype
    ``dtype``, default ``head_dtype(weight)``) into one reused buffer, ``lse = logsumexp(z)``, ``logp =
    z[target] - lse`` and the entropy ``H = lse - sum softmax(z) z`` (no gradient). Only ``lse`` ``[M]``
    is saved. Backward recomputes each chunk's logits in the same buffer and uses ``d logp / d z =
    onehot(target) - softmax(z)`` and ``d z / d raw = (s / T)(1 - (T z / c)^2)`` (``LogitTransform``):
    with ``dr = g (onehot - p) d z / d raw``, ``grad_h = dr W``, ``grad_W = dr^T h``, ``grad_b = sum dr``;
    the two matmuls run in the compute dtype with float32 accumulation (``weight_mm``,
    ``activations_mm_``: ``W`` rounded, ``dr`` and ``h`` in two parts; on CUDA ``grads_in_parts_``, the parts in
    ``dr``'s own storage). Unlike autograd over a checkpointed ``log_softmax``, no chunk allocates fresh
    vocabulary-sized float32 temporaries, so peak memory is two ``[chunk, vocab]`` float32 buffers plus ``grad_W``
    (the logits and a scratch in the forward, the logits and their two half-precision parts in the backward).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk, with_entropy=True, transform=None, dtype=None):
        transform = transform or LogitTransform()
        dtype = head_dtype(weight) if dtype is None else dtype
        m = h.shape[0]
        out = logits_dtype(dtype)  # float32 (float64 for a float64 head)
        logp = torch.empty(m, dtype=out, device=h.device)
        entropy = torch.zeros(m, dtype=out, device=h.device)
        lse = torch.empty(m, dtype=out, device=h.device)
        buffers = _LogitBuffers(min(chunk, m), LMHead(weight, bias, transform, dtype), temperature)
        for i in range(0, m, chunk):
            z = buffers.logits(h[i : i + chunk])
            lse[i : i + chunk] = z.logsumexp(-1)
            logp[i : i + chunk] = z.gather(-1, targets[i : i + chunk].unsqueeze(-1)).squeeze(-1) - lse[i : i + chunk]
            if with_entropy:
                p = buffers.scratch(z.shape[0])
                torch.sub(z, lse[i : i + chunk].unsqueeze(-1), out=p).exp_()
                entropy[i : i + chunk] = lse[i : i + chunk] - p.mul_(z).sum(-1)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.transform, ctx.dtype = temperature, chunk, transform, dtype
        ctx.device_type = h.device.type
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        # autocast off, as in the forward: a CPU backward runs on the calling thread, under training_step's autocast
        # (bf16-mixed), which rounded the float32 products to bf16 (grad_h 2e-3 off); CUDA's backward thread has none
        if not torch.amp.is_autocast_available(ctx.device_type):  # meta: no autocast to leave
            return _grads(ctx, grad_logp)
        with torch.autocast(ctx.device_type, enabled=False):
            return _grads(ctx, grad_logp)


def _grads(ctx, grad_logp):
    """``TokenLogprobs.backward``'s gradients (its docstring), autocast off."""
    h, weight, bias, targets, lse = ctx.saved_tensors
    temperature, chunk, transform, dtype = ctx.temperature, ctx.chunk, ctx.transform, ctx.dtype
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_h = torch.empty_like(h) if need_h else None
    acc = logits_dtype(dtype)  # float32; float64 for a float64 head
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    head = LMHead(weight, bias, transform, dtype)
    buffers = _LogitBuffers(min(chunk, h.shape[0]), head, temperature)
    for i in range(0, h.shape[0], chunk):
        hc, g = h[i : i + chunk], grad_logp[i : i + chunk].to(acc) * (transform.scale / temperature)
        z = buffers.logits(hc)
        slope = None
        if transform.softcap is not None:  # 1 - tanh^2 = 1 - (T z / c)^2, before z is overwritten
            slope = buffers.scratch(z.shape[0])
            torch.mul(z, temperature / transform.softcap, out=slope).square_().neg_().add_(1.0)
        # z <- d loss / d raw = g (onehot(target) - softmax(z)) (s / T) [x slope], in place
        z.sub_(lse[i : i + chunk].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
        z.scatter_add_(-1, targets[i : i + chunk].unsqueeze(-1), g.unsqueeze(-1))
        if slope is not None:
            z.mul_(slope)
        if need_b:
            grad_b += z.sum(0)
        if dtype in (torch.float32, torch.float64):  # 32-true: the float32 matmuls as they always were
            if need_h and grad_h.dtype == acc:
                torch.mm(z, weight, out=grad_h[i : i + chunk])
            elif need_h:
                grad_h[i : i + chunk] = torch.mm(z, weight)
            if need_w:
                grad_w.addmm_(z.t(), hc.to(acc))
        elif not _fp32_output(z.device.type, dtype):  # CPU: float32 products of the rounded weight
            if need_h:
                grad_h[i : i + chunk] = weight_mm(z, head.weight, dtype, stacked=head.stacked(0))
            if need_w:
                activations_mm_(grad_w, z.t(), hc, dtype)
        else:
            rows_h = grad_h[i : i + chunk] if need_h else None
            grads_in_parts_(z, hc, head, dtype, rows_h, grad_w if need_w else None)
    cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
    grad_bias = None if bias is None else cast(grad_b, bias)
    return grad_h, cast(grad_w, weight), grad_bias, None, None, None, None, None, None


class _LogitBuffers:
    """``[chunk, vocab]`` float32 buffers reused across chunks: logits, and scratch for the entropy and the
    soft-cap slope."""

    def __init__(self, chunk: int, head: LMHead, temperature: float) -> None:
        self.head, self.temperature = head, temperature
        dtype = logits_dtype(head.dtype)
        self.z = torch.empty(chunk, head.weight.shape[0], dtype=dtype, device=head.weight.device)
        self.p: Tensor | None = None  # allocated on first use

    def logits(self, h: Tensor) -> Tensor:
        return self.head(h, self.temperature, out=self.z[: h.shape[0]])

    def scratch(self, rows: int) -> Tensor:
        if self.p is None:
            self.p = torch.empty_like(self.z)
        return self.p[:rows]


def log_softmax_at(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[tokens]`` per row: float32 ``[R]`` for ``logits`` ``[R, V]`` and ``tokens`` ``[R]``."""
    z = logits.float()
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
