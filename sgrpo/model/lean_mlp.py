"""A SwiGLU MLP whose gradient pass keeps two of its four intermediate activations (``model.lean_mlp``).

Llama, Qwen2/3 and Mistral compute ``y = W_d (silu(g) * u) + b_d`` with ``g = W_g x`` and ``u = W_u x``. Autograd keeps
four tensors of the intermediate width ``I`` per token for the backward: ``g`` (silu's input), ``silu(g)`` and ``u``
(the product's operands) and ``a = silu(g) * u`` (the down projection's input). ``SwiGLUDown`` keeps ``g`` and ``u``
only and recomputes ``silu(g)`` and ``a`` in the backward (elementwise, no matmul):

    a = silu(g) * u,  dW_d = dy^T a,  db_d = sum_tokens dy,  da = dy W_d,
    du = da * silu(g),  dg = silu'(g) * (da * u),  silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))

the same operations autograd runs (``aten.silu_backward`` for ``silu'``), so the forward is bit-identical and the
gradients equal the standard MLP's up to the order of the matmul's sums. Under autocast the down projection computes
in the autocast dtype as ``F.linear`` does there (``a``, ``W_d``, ``b_d`` cast; their gradients cast back).

In the MLP this saves ``2 I`` of the ``4 I`` intermediate values per token and layer: about a third of a
Llama-shaped decoder layer's activations (``I`` about 2.7-5.4 times the hidden size). It applies only where the
down projection is a plain ``nn.Linear`` with no hooks and local weights (``lean_mlp_problem``); elsewhere (LoRA,
quantised layers, a tensor-parallel shard, a hook on the projection) and without gradients the module runs its
own forward. Like ``fully_shard``, ``apply_lean_mlp`` swaps each eligible module's class for a subclass
(``Lean<Class>``) whose ``forward`` takes the lean path; parameters, state dict and checkpoints are unchanged. A
module is eligible when it has the SwiGLU layout (``is_swiglu_mlp``) and its own forward on a probe input equals
the formula above bit for bit (``computes_swiglu``): a module with the same parts but another formula keeps its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

_LEAN_CLASSES: dict[type, type] = {}


class SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)`` saving ``gate`` and ``up`` (module docstring's formulas)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = F.linear(F.silu(gate) * up, weight, bias)  # under autocast: computed in its dtype, as F.linear is
        ctx.save_for_backward(gate, up, weight)
        ctx.compute_dtype = out.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        gate, up, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        silu = F.silu(gate)
        act = silu * up
        grad2 = grad_out.to(dtype).reshape(-1, grad_out.shape[-1])
        grad_weight = grad_bias = grad_gate = grad_up = None
        if ctx.needs_input_grad[2]:  # the standard backward's (a^T dy)^T, in the compute dtype, cast back
            grad_weight = act.to(dtype).reshape(-1, act.shape[-1]).t().mm(grad2).t().to(weight.dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad2.sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_act = grad2.mm(weight.to(dtype)).reshape(act.shape).to(act.dtype)
            if ctx.needs_input_grad[0]:
                grad_gate = torch.ops.aten.silu_backward(grad_act * up, gate)
            if ctx.needs_input_grad[1]:
                grad_up = grad_act * silu
        return grad_gate, grad_up, grad_weight, grad_bias


def is_swiglu_mlp(module: nn.Module) -> bool:
    """A transformers-style SwiGLU MLP: ``gate_proj``, ``up_proj`` and ``down_proj`` linears and a SiLU ``act_fn``."""
    act = getattr(module, "act_fn", None)
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def lean_mlp_problem(module: nn.Module) -> str | None:
    """Why ``module``'s forward cannot take the lean path now, or None (checked at each gradient-pass call: LoRA, FSDP
    and hooks can arrive after ``apply_lean_mlp``)."""
    down = module.down_proj
    if type(down) is not nn.Linear:
        return f"its down projection is a {type(down).__name__}, not a plain nn.Linear"
    hooks = (down._forward_hooks, down._forward_pre_hooks, down._backward_hooks, down._backward_pre_hooks,
             nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
    if any(hooks):
        return "its down projection has hooks"
    if type(down.weight) is not nn.Parameter and type(down.weight) is not torch.Tensor:
        return f"its down projection's weight is a {type(down.weight).__name__}"
    return None


def lean_class(cls: type) -> type:
    """``Lean<cls>``: ``cls`` with the lean gradient pass (one subclass per class, cached). Its ``forward`` falls back
    to ``cls.forward`` by name, not by ``super``, so a further subclass (``fully_shard`` swaps classes too) cannot
    make it call itself."""
    if cls not in _LEAN_CLASSES:

        def forward(self, x: Tensor) -> Tensor:
            if not torch.is_grad_enabled() or lean_mlp_problem(self) is not None:
                return cls.forward(self, x)
            return SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight, self.down_proj.bias)

        _LEAN_CLASSES[cls] = type(f"Lean{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _LEAN_CLASSES[cls]


def computes_swiglu(module: nn.Module) -> bool:
    """Whether ``module``'s own forward is ``down(silu(gate(x)) * up(x))``: both on a random two-token input, without
    gradients, equal bit for bit (False where the weights are not materialised, e.g. on the meta device)."""
    weight = module.gate_proj.weight
    if weight.is_meta or type(weight) not in (nn.Parameter, torch.Tensor):
        return False
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(1, 2, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)
    down = module.down_proj
    with torch.no_grad():
        return torch.equal(module(x), down(module.act_fn(module.gate_proj(x)) * module.up_proj(x)))


def apply_lean_mlp(model: nn.Module) -> int:
    """Give every SwiGLU MLP in ``model`` the lean gradient pass; returns how many modules changed (0: none found)."""
    changed = 0
    for module in model.modules():
        lean = isinstance(module, tuple(_LEAN_CLASSES.values()))
        if not lean and is_swiglu_mlp(module) and computes_swiglu(module):
            module.__class__ = lean_class(type(module))
            changed += 1
    return changed
