"""The LM head, computed one way for sampling and for the loss: float32 logits, the model's own transform.

Both the rollout's sampler and the policy loss turn a final hidden state ``h`` into logits here, so the
policy that samples is the policy that is trained:

* the matmul ``h W^T + b`` runs in the head weight's dtype, outside autocast (under bf16-mixed the
  fp32 master weights give fp32 logits; a bf16 model's logits are its bf16 matmul), then in float32;
* the model's own output transform follows (``LogitTransform``: Gemma 2/3 final-logit soft-capping,
  Granite ``logits_scaling``, Cohere ``logit_scale``), then the sampling temperature.

``check_logit_head`` compares this against the model's own forward when the model loads, and refuses
a model whose forward does something else to its logits.
"""

from __future__ import annotations

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


def head_logits(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    transform: LogitTransform | None = None,
    temperature: float = 1.0,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """float32 logits ``[M, V]`` = ``transform(h W^T + b) / temperature`` for hidden states ``h`` ``[M, H]``.

    The matmul runs in ``weight``'s dtype with autocast off; ``out`` (float32) and ``scratch`` (the
    weight's dtype, for half-precision weights) are optional reusable buffers.
    """
    with torch.autocast(h.device.type, enabled=False):
        h = h.to(weight.dtype)
        if weight.dtype == torch.float32:
            z = torch.mm(h, weight.t(), out=out)
        else:  # half-precision weights: the matmul in their dtype, everything after in float32
            raw = torch.mm(h, weight.t(), out=scratch)
            z = raw.float() if out is None else out.copy_(raw)
        if bias is not None:
            z.add_(bias)
    if transform is not None:
        transform.apply_(z)
    return z.div_(temperature) if temperature != 1.0 else z


def model_head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """``head_logits`` with ``model``'s own LM head and transform: float32 ``[M, V]`` for ``hidden`` ``[M, H]``."""
    head = model.get_output_embeddings()
    return head_logits(hidden, head.weight, head.bias, LogitTransform.of(model))


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
    rounding = 1e-4 if model.get_output_embeddings().weight.dtype == torch.float32 else 2e-2
    gap = float((ours - theirs).abs().max())
    if not gap <= rounding * max(1.0, float(theirs.abs().max())):  # NaN fails too
        name = type(model).__name__
        raise ValueError(
            f"{name}'s forward turns its hidden states into logits in a way sgrpo does not model (max "
            f"difference {gap:.3g} from lm_head with {LogitTransform.of(model)}); sgrpo applies "
            "final_logit_softcapping, logits_scaling and logit_scale. Training would use wrong log-probs: "
            "use another model, or add its transform to sgrpo.head.LogitTransform"
        )


class TokenLogprobs(torch.autograd.Function):
    """``log softmax(transform(h W^T + b) / T)[target]`` per token, chunk by chunk, never holding ``[M, vocab]``.

    Forward: for each chunk of ``chunk`` tokens, logits ``z`` (``head_logits``) into one reused buffer,
    ``lse = logsumexp(z)``, ``logp = z[target] - lse`` and the entropy ``H = lse - sum softmax(z) z``
    (no gradient). Only ``lse`` ``[M]`` is saved. Backward recomputes each chunk's logits in the same
    buffer and uses ``d logp / d z = onehot(target) - softmax(z)`` and ``d z / d raw = (s / T)(1 - (T z /
    c)^2)`` (``LogitTransform``): with ``dr = g (onehot - p) d z / d raw``, ``grad_h = dr W``,
    ``grad_W = dr^T h``, ``grad_b = sum dr``. Unlike autograd over a checkpointed ``log_softmax``, no
    chunk allocates fresh vocabulary-sized temporaries, so peak memory is one or two ``[chunk, vocab]``
    float32 buffers plus ``grad_W``.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk, with_entropy=True, transform=None):
        transform = transform or LogitTransform()
        m = h.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=h.device)
        entropy = torch.zeros(m, dtype=torch.float32, device=h.device)
        lse = torch.empty(m, dtype=torch.float32, device=h.device)
        buffers = _LogitBuffers(min(chunk, m), weight, transform, temperature)
        for i in range(0, m, chunk):
            z = buffers.logits(h[i : i + chunk], bias)
            lse[i : i + chunk] = z.logsumexp(-1)
            logp[i : i + chunk] = z.gather(-1, targets[i : i + chunk].unsqueeze(-1)).squeeze(-1) - lse[i : i + chunk]
            if with_entropy:
                p = buffers.scratch(z.shape[0])
                torch.sub(z, lse[i : i + chunk].unsqueeze(-1), out=p).exp_()
                entropy[i : i + chunk] = lse[i : i + chunk] - p.mul_(z).sum(-1)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.transform = temperature, chunk, transform
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        h, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk, transform = ctx.temperature, ctx.chunk, ctx.transform
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        buffers = _LogitBuffers(min(chunk, h.shape[0]), weight, transform, temperature)
        for i in range(0, h.shape[0], chunk):
            hc, g = h[i : i + chunk], grad_logp[i : i + chunk].float() * (transform.scale / temperature)
            z = buffers.logits(hc, bias)
            slope = None
            if transform.softcap is not None:  # 1 - tanh^2 = 1 - (T z / c)^2, before z is overwritten
                slope = buffers.scratch(z.shape[0])
                torch.mul(z, temperature / transform.softcap, out=slope).square_().neg_().add_(1.0)
            # z <- d loss / d raw = g (onehot(target) - softmax(z)) (s / T) [x slope], in place
            z.sub_(lse[i : i + chunk].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
            z.scatter_add_(-1, targets[i : i + chunk].unsqueeze(-1), g.unsqueeze(-1))
            if slope is not None:
                z.mul_(slope)
            dz = z if z.dtype == weight.dtype else z.to(weight.dtype)
            if need_h:
                if grad_h.dtype == weight.dtype:
                    torch.mm(dz, weight, out=grad_h[i : i + chunk])
                else:
                    grad_h[i : i + chunk] = torch.mm(dz, weight)
            if need_w:
                grad_w.addmm_(z.t(), hc.float())
            if need_b:
                grad_b += z.sum(0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        grad_bias = None if bias is None else cast(grad_b, bias)
        return grad_h, cast(grad_w, weight), grad_bias, None, None, None, None, None


class _LogitBuffers:
    """``[chunk, vocab]`` float32 buffers reused across chunks: logits, and scratch for the entropy and the
    soft-cap slope (plus one in the weight's dtype for the matmul of half-precision weights)."""

    def __init__(self, chunk: int, weight: Tensor, transform: LogitTransform, temperature: float) -> None:
        self.weight, self.transform, self.temperature = weight, transform, temperature
        self.z = torch.empty(chunk, weight.shape[0], dtype=torch.float32, device=weight.device)
        self.p: Tensor | None = None  # allocated on first use
        self.raw = None if weight.dtype == torch.float32 else torch.empty_like(self.z, dtype=weight.dtype)

    def logits(self, h: Tensor, bias: Tensor | None) -> Tensor:
        rows = h.shape[0]
        raw = None if self.raw is None else self.raw[:rows]
        return head_logits(h, self.weight, bias, self.transform, self.temperature, out=self.z[:rows], scratch=raw)

    def scratch(self, rows: int) -> Tensor:
        if self.p is None:
            self.p = torch.empty_like(self.z)
        return self.p[:rows]


def log_softmax_at(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[tokens]`` per row: float32 ``[R]`` for ``logits`` ``[R, V]`` and ``tokens`` ``[R]``."""
    z = logits.float()
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)

