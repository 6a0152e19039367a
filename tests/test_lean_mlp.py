"""``model.lean_mlp`` (``sgrpo.model.lean_mlp``): the SwiGLU MLP's backward recomputes ``silu(g) * u``: the same
log-probs and gradients as the standard module, two of the four intermediate-width activations kept, and the
module's own forward wherever the lean path does not apply (LoRA, hooks, no gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sgrpo.model.lean_mlp import SwiGLUDown, apply_lean_mlp, lean_mlp_problem
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama

TOKENIZER = build_char_tokenizer()
INTERMEDIATE = 96


def pair(dtype=torch.float32):
    """(standard, lean): the same random 2-layer Llama, hidden 32, intermediate ``INTERMEDIATE``."""
    torch.manual_seed(0)
    model = build_tiny_llama(TOKENIZER, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=INTERMEDIATE)
    model = model.to(dtype)
    lean = copy.deepcopy(model)
    assert apply_lean_mlp(lean) == 2
    return model, lean


def ids(rows=3, length=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(TOKENIZER), (rows, length), generator=g)


def logits_and_grads(model, x, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in a)


@pytest.mark.parametrize(
    "dtype, autocast, tolerance",
    [(torch.float32, False, 1e-6), (torch.float64, False, 1e-12), (torch.bfloat16, False, 1e-6),
     (torch.float32, True, 1e-6)],
    ids=["fp32", "fp64", "bf16", "bf16-autocast"],
)
def test_lean_mlp_gives_the_standard_logits_and_gradients(dtype, autocast, tolerance):
    """Forward bit-identical; every parameter's gradient within ``tolerance`` relative (in fp32, bf16 and under CPU
    bf16 autocast the backward runs the standard graph's operations in its order: measured bit-identical)."""
    model, lean = pair(dtype)
    x = ids()
    logits, grads = logits_and_grads(model, x, autocast)
    lean_logits, lean_grads = logits_and_grads(lean, x, autocast)
    assert torch.equal(lean_logits, logits)
    assert worst_relative(lean_grads, grads) <= tolerance
    assert all(g.abs().max() > 0 for g in grads.values())
    if autocast:
        assert lean_logits.dtype == torch.bfloat16


def test_swiglu_down_by_hand():
    """``SwiGLUDown`` against the formulas written out: y = W (silu(g) u) + b; dW = dy^T a; db = sum dy;
    da = dy W; du = da silu(g); dg = da u sigmoid(g) (1 + g (1 - sigmoid(g)))."""
    g = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([[1.5, 0.25, -0.5]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.1, -0.2], dtype=torch.float64, requires_grad=True)
    dy = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    y = SwiGLUDown.apply(g, u, w, b)
    y.backward(dy)
    sig = [1 / (1 + torch.exp(-v)).item() for v in g.detach()[0]]
    silu = [gv * s for gv, s in zip(g.detach()[0].tolist(), sig)]
    a = [s * uv for s, uv in zip(silu, u.detach()[0].tolist())]
    expected_y = [sum(w[r, k].item() * a[k] for k in range(3)) + b[r].item() for r in range(2)]
    da = [1.0 * w[0, k].item() - 2.0 * w[1, k].item() for k in range(3)]
    gv = g.detach()[0].tolist()
    uv = u.detach()[0].tolist()
    expected_dg = [da[k] * uv[k] * sig[k] * (1 + gv[k] * (1 - sig[k])) for k in range(3)]
    torch.testing.assert_close(y.detach()[0], torch.tensor(expected_y, dtype=torch.float64))
    expected_dw = torch.tensor([[1.0 * ak for ak in a], [-2.0 * ak for ak in a]], dtype=torch.float64)
    torch.testing.assert_close(w.grad, expected_dw)
    torch.testing.assert_close(b.grad, torch.tensor([1.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(u.grad[0], torch.tensor([da[k] * silu[k] for k in range(3)], dtype=torch.float64))
    torch.testing.assert_close(g.grad[0], torch.tensor(expected_dg, dtype=torch.float64))


def saved_intermediates(model, x) -> int:
    """Distinct tensors of the MLP's intermediate width that autograd keeps for one forward of ``model``."""
    storages = set()

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == INTERMEDIATE and t.shape[-2] != 32:  # activations, not W_gate/W_up
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x).logits.sum()
    return len(storages)


def test_lean_mlp_keeps_two_of_the_four_intermediate_activations():
    model, lean = pair()
    x = ids()
    assert saved_intermediates(model, x) == 4 * 2  # g, silu(g), u, silu(g) u in each of 2 layers
    assert saved_intermediates(lean, x) == 2 * 2  # g and u
    with torch.no_grad():  # rollouts and reference log-probs: the module's own forward, nothing saved anyway
        torch.testing.assert_close(lean(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)


def test_lean_mlp_takes_the_modules_own_forward_where_it_cannot_apply():
    """LoRA on the down projection, or a forward hook on it: the standard path (four activations kept, the hook
    called); the reason named by ``lean_mlp_problem``."""
    from sgrpo.model.lora import LoRA, apply_lora

    _, lean = pair()
    x = ids()
    calls = []
    mlp = lean.model.layers[0].mlp
    handle = mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    assert lean_mlp_problem(mlp) == "its down projection has hooks"
    assert saved_intermediates(lean, x) == 4 + 2  # layer 0 standard, layer 1 lean
    assert calls == [1]
    handle.remove()
    assert lean_mlp_problem(mlp) is None
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)  # a global hook sees every call
    try:
        assert lean_mlp_problem(mlp) == "its down projection has hooks"
    finally:
        handle.remove()
    apply_lora(lean, LoRA(rank=2, dropout=0.0))
    assert "not a plain nn.Linear" in lean_mlp_problem(mlp)
    model, _ = pair()
    apply_lora(model, LoRA(rank=2, dropout=0.0))
    lean_grads = logits_and_grads(lean, x)[1]
    assert worst_relative(lean_grads, logits_and_grads(model, x)[1]) == 0.0


class OtherFormulaMLP(nn.Module):
    """The SwiGLU parts, another formula: ``down(silu(gate(x)) + up(x))``."""

    def __init__(self, hidden=8, intermediate=16):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, intermediate), nn.Linear(hidden, intermediate)
        self.down_proj, self.act_fn = nn.Linear(intermediate, hidden), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


def test_a_module_with_the_parts_but_another_formula_keeps_its_forward():
    other = OtherFormulaMLP()
    assert apply_lean_mlp(other) == 0 and type(other) is OtherFormulaMLP
    with torch.device("meta"):
        meta = build_tiny_llama(TOKENIZER, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64)
    assert apply_lean_mlp(meta) == 0  # weights not materialised: nothing to probe, nothing changed


def test_apply_lean_mlp_keeps_the_state_dict_and_copies():
    model, lean = pair()
    mlp = lean.model.layers[0].mlp
    assert type(mlp).__name__ == "LeanLlamaMLP" and isinstance(mlp, type(model.model.layers[0].mlp))
    assert lean.state_dict().keys() == model.state_dict().keys()
    assert apply_lean_mlp(lean) == 0  # already lean: nothing changes
    assert type(copy.deepcopy(lean).model.layers[1].mlp) is type(mlp)
    assert apply_lean_mlp(nn.Sequential(nn.Linear(2, 2))) == 0  # no SwiGLU MLP: untouched
    mlp.__class__ = type("Wrapped", (type(mlp),), {})  # a class swapped again on top (as fully_shard does)
    assert apply_lean_mlp(lean) == 0
    x = torch.randn(2, 3, 32, requires_grad=True)
    mlp(x).sum().backward()  # the lean path, not a recursion into itself
    assert x.grad is not None and x.grad.abs().sum() > 0
