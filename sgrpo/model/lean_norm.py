"""An RMSNorm whose gradient pass keeps its input and one number per row (``model.lean_norm``).

Llama, Qwen2/3 and Mistral normalise as ``y = w * (x32 * r).to(dtype)`` with ``x32 = x.to(float32)``,
``r = rsqrt(mean(x32^2) + eps)`` over the last dimension and ``dtype`` the input's (Zhang & Sennrich 2019, RMSNorm).
Autograd keeps two tensors of the normalised width per row for the backward: ``x32`` (the square's and the
product's operand: a float32 copy when ``x`` is bf16) and ``n = (x32 * r).to(dtype)`` (the weight product's
operand). ``RMSNormLean`` keeps ``x`` as it came (the residual stream, alive anyway in float32 runs) and ``r``, and
recomputes ``n`` in the backward (elementwise). With ``g`` the output's gradient, ``h`` the width and sums over the
width:

    dw = sum_rows g * n,  dn = (g * w).to(float32),
    dx32 = dn * r + (-0.5 * sum(dn * x32) * r^3) / h * (2 * x32),  dx = dx32.to(dtype)

the operations autograd runs for transformers' module, in its order (in float32 ``x32`` is ``x`` itself, and the
product's and the square's gradients reach it one after the other: ``x`` goes in twice so they still do), so the
forward is bit-identical and the gradients are too (measured in fp32, bf16 and under CPU bf16 autocast in
``tests/test_lean_norm.py``). Per norm and token this saves ``4 h`` bytes: in fp32 ``n``, in bf16 ``x32`` less ``x``
plus ``n``. For Qwen3-8B in bf16 (two norms of 4,096 per layer, and per-head norms over its 4,096 query and 1,024
key values) that is 52 KiB per token and layer.

``apply_lean_norm`` swaps each module whose own forward is that formula bit for bit (``computes_rms_norm``, probed
on a random weight in float32 and bfloat16) for a subclass (``Lean<Class>``, as ``sgrpo.model.lean_mlp`` does for
the MLP); parameters, state dict and checkpoints are unchanged. A gated norm (``forward(x, gate)``: Granite 4.0-H,
Bamba, Qwen3-Next) keeps its own. Without gradients, or with a weight that is not a plain local tensor (a
tensor-parallel shard), the module runs its own forward.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

_LEAN_CLASSES: dict[type, type] = {}


def _normalised(x: Tensor, r: Tensor) -> Tensor:
    return (x.to(torch.float32) * r).to(x.dtype)


class RMSNormLean(torch.autograd.Function):
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` saving ``x`` and ``r`` (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, again: Tensor | None, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(torch.float32)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return weight * _normalised(x, r)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, r, weight = ctx.saved_tensors
        n = _normalised(x, r)
        grad_x = grad_again = grad_weight = None
        if ctx.needs_input_grad[2]:  # the weight product's: g * n summed to the weight's shape, in its dtype
            grad_weight = (grad_out * n).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_n = (grad_out * weight).to(x.dtype).to(torch.float32)
            x32 = x.to(torch.float32)
            grad_r = (grad_n * x32).sum(-1, keepdim=True)
            grad_mean = (-0.5 * grad_r * r.pow(3)).expand(x32.shape) / x32.shape[-1]
            through_product, through_square = grad_n * r, grad_mean * (2.0 * x32.pow(1.0))
            if ctx.needs_input_grad[1]:  # float32: x is x32, and the two paths reach it apart, as in autograd's graph
                grad_x, grad_again = through_product, through_square
            else:  # x32 is a cast of x: the paths add up in float32, then the cast's backward
                grad_x = (through_product + through_square).to(x.dtype)
        return grad_x, grad_again, grad_weight, None


def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def lean_norm_problem(module: nn.Module) -> str | None:
    """Why ``module``'s forward cannot take the lean path now, or None (checked at each gradient-pass call)."""
    if type(module.weight) is not nn.Parameter and type(module.weight) is not torch.Tensor:
        return f"its weight is a {type(module.weight).__name__}"
    return None


def lean_class(cls: type) -> type:
    """``Lean<cls>``: ``cls`` with the lean gradient pass (cached; falls back to ``cls.forward`` by name)."""
    if cls not in _LEAN_CLASSES:

        def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
            if args or kwargs or not torch.is_grad_enabled() or lean_norm_problem(self) is not None:
                return cls.forward(self, hidden_states, *args, **kwargs)  # a gated norm's gate: its own forward
            again = hidden_states if hidden_states.dtype == torch.float32 else None
            return RMSNormLean.apply(hidden_states, again, self.weight, _eps(self))

        _LEAN_CLASSES[cls] = type(f"Lean{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _LEAN_CLASSES[cls]


def computes_rms_norm(module: nn.Module) -> bool:
    """Whether ``module``'s own forward is the module docstring's formula: a copy with a random weight, on a random
    input in float32 and in bfloat16, without gradients, equal bit for bit (False for a module without a 1-d
    ``weight`` and a float ``variance_epsilon`` / ``eps``, or whose weight is not materialised)."""
    weight = getattr(module, "weight", None)
    if type(weight) not in (nn.Parameter, torch.Tensor) or weight.dim() != 1 or weight.is_meta:
        return False
    if _eps(module) is None or len(module._parameters) != 1 or not _takes_one_input(type(module)):
        return False
    probe = copy.deepcopy(module)
    generator = torch.Generator(device=weight.device).manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=generator, device=weight.device))
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 3, weight.shape[0], generator=generator, device=weight.device).to(dtype)
            x32 = x.to(torch.float32)
            r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _eps(module))
            try:
                if not torch.equal(probe(x), probe.weight * _normalised(x, r)):
                    return False
            except Exception:  # a module whose forward wants more than the input (or another shape)
                return False
    return True


def _takes_one_input(cls: type) -> bool:
    """Whether ``cls.forward`` takes the hidden states alone: not a gated norm's ``forward(x, gate=None)`` (Granite
    4.0-H, Bamba, Zamba2, Qwen3-Next), where the gate changes the formula."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 1 and parameters[0].kind in positional


def apply_lean_norm(model: nn.Module) -> int:
    """Give every RMSNorm of the formula in ``model`` the lean gradient pass; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, tuple(_LEAN_CLASSES.values())) and computes_rms_norm(module):
            module.__class__ = lean_class(type(module))
            changed += 1
    return changed
