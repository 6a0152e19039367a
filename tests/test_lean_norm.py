"""``model.lean_norm`` (``sgrpo.model.lean_norm``): an RMSNorm's backward recomputes its normalised input: the same
log-probs and gradients as transformers' module bit for bit, 4 bytes per norm, token and hidden unit fewer kept for
the backward, and the module's own forward wherever the lean path does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sgrpo.model.lean_mlp import apply_lean_mlp
from sgrpo.model.lean_norm import RMSNormLean, apply_lean_norm, computes_rms_norm, lean_norm_problem
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from tests.test_lean_mlp import ids, logits_and_grads

TOKENIZER = build_char_tokenizer()
HIDDEN = 32


def pair(dtype=torch.float32):
    """(standard, lean): the same random 2-layer Llama (its norms' weights random too), hidden ``HIDDEN``."""
    torch.manual_seed(0)
    model = build_tiny_llama(TOKENIZER, hidden_size=HIDDEN, num_layers=2, num_heads=4, intermediate_size=96)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.weight.normal_()
    model = model.to(dtype)
    lean = copy.deepcopy(model)
    assert apply_lean_norm(lean) == 5  # two per layer and the final norm
    return model, lean


@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.float64, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "fp64", "bf16", "bf16-autocast"],
)
@pytest.mark.parametrize("lean_mlp", [False, True], ids=["mlp", "lean-mlp"])
def test_lean_norm_gives_the_standard_logits_and_gradients_bit_for_bit(dtype, autocast, lean_mlp):
    """The backward runs autograd's operations for transformers' module in its order (in float32 the two paths to
    the input reach it apart, as in the standard graph), so every gradient is bit-identical."""
    model, lean = pair(dtype)
    if lean_mlp:
        apply_lean_mlp(model), apply_lean_mlp(lean)
    x = ids()
    logits, grads = logits_and_grads(model, x, autocast)
    lean_logits, lean_grads = logits_and_grads(lean, x, autocast)
    assert torch.equal(lean_logits, logits)
    assert grads.keys() == lean_grads.keys() and len(grads) == 20
    assert all(torch.equal(lean_grads[n], grads[n]) for n in grads)
    assert all(g.abs().max() > 0 for g in grads.values())


def test_rms_norm_lean_by_hand():
    """``RMSNormLean`` against the formulas written out for h = 2: r = (mean x^2 + eps)^-1/2, y = w x r,
    dw = g x r, dx_i = r (g_i w_i) - r^3 x_i mean_j(g_j w_j x_j)."""
    x = torch.tensor([[3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([2.0, 0.5], dtype=torch.float64, requires_grad=True)
    g = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    eps = 0.5
    y = RMSNormLean.apply(x, None, w, eps)
    y.backward(g)
    r = (12.5 + eps) ** -0.5  # mean(9, 16) = 12.5
    torch.testing.assert_close(y.detach(), torch.tensor([[2.0 * 3 * r, 0.5 * -4 * r]], dtype=torch.float64))
    torch.testing.assert_close(w.grad, torch.tensor([3 * r, 4 * r], dtype=torch.float64))
    gw = [1.0 * 2.0, -1.0 * 0.5]
    mean_gwx = (gw[0] * 3 + gw[1] * -4) / 2
    expected = [r * gw[i] - r**3 * xi * mean_gwx for i, xi in enumerate([3.0, -4.0])]
    torch.testing.assert_close(x.grad, torch.tensor([expected], dtype=torch.float64))


def saved_bytes(model, x) -> int:
    """Bytes of the distinct activations of the hidden width that autograd keeps for one forward (weights aside)."""
    storages = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == HIDDEN and not isinstance(t, nn.Parameter) and t.shape[-2] != HIDDEN:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x).logits.sum()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_norm_keeps_4_bytes_less_per_norm_token_and_hidden_unit(dtype):
    """Each of the 5 norms keeps its input and one float per row instead of its float32 input and its normalised
    input: 4 bytes less per hidden unit and token (in fp32 the normalised copy; in bf16 the float32 copy, 4 bytes,
    and the bf16 normalised input, 2, against the bf16 input, 2)."""
    model, lean = pair(dtype)
    x = ids()
    tokens = x.numel()
    assert saved_bytes(model, x) - saved_bytes(lean, x) == 5 * 4 * HIDDEN * tokens
    with torch.no_grad():  # rollouts and reference log-probs: the module's own forward
        assert torch.equal(lean(input_ids=x).logits, model(input_ids=x).logits)


def test_apply_lean_norm_takes_only_the_formula_and_keeps_the_state_dict():
    model, lean = pair()
    norm = lean.model.layers[0].input_layernorm
    assert type(norm).__name__ == "LeanLlamaRMSNorm" and isinstance(norm, type(model.model.layers[0].input_layernorm))
    assert lean.state_dict().keys() == model.state_dict().keys()
    assert apply_lean_norm(lean) == 0  # already lean
    assert type(copy.deepcopy(lean).model.norm) is type(lean.model.norm)

    class OneOffset(nn.Module):  # Gemma's form: (1 + w) * x r, in float32, cast after
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.zeros(4)), 1e-6

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).type_as(x)

    assert not computes_rms_norm(OneOffset())  # probed with a random weight: the offset shows
    assert not computes_rms_norm(nn.LayerNorm(4))  # a bias: not an RMSNorm
    with torch.device("meta"):
        meta = build_tiny_llama(TOKENIZER, hidden_size=HIDDEN, num_layers=1, num_heads=4, intermediate_size=64)
    assert apply_lean_norm(meta) == 0  # weights not materialised: nothing to probe


def test_lean_norm_takes_the_modules_own_forward_without_gradients_or_with_a_foreign_weight():
    _, lean = pair()
    norm = lean.model.norm
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    assert lean_norm_problem(norm) is None
    assert norm(x).grad_fn.name() == "RMSNormLeanBackward"
    with torch.no_grad():
        assert norm(x).grad_fn is None

    class Shard(torch.Tensor):  # stands for a tensor-parallel DTensor
        pass

    norm.weight = nn.Parameter(norm.weight.detach().as_subclass(Shard))
    assert lean_norm_problem(norm) is not None
    assert norm(x).grad_fn.name() != "RMSNormLeanBackward"


@pytest.mark.parametrize(
    "dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "bf16-autocast"],
)
def test_qwen3s_per_head_query_and_key_norms_take_the_lean_path_too(dtype, autocast):
    """Qwen3 normalises each head's queries and keys as well: 4 norms per layer and the final one, all lean, the
    logits and gradients bit-identical."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen3ForCausalLM(config).to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.weight.normal_()
    lean = copy.deepcopy(model)
    assert apply_lean_norm(lean) == 2 * 4 + 1
    x = ids(2, 9)
    logits, grads = logits_and_grads(model, x, autocast)
    lean_logits, lean_grads = logits_and_grads(lean, x, autocast)
    assert torch.equal(lean_logits, logits)
    assert all(torch.equal(lean_grads[n], grads[n]) for n in grads) and len(grads) == len(lean_grads)


class GatedNorm(nn.Module):
    """A gated RMSNorm (Granite 4.0-H, Bamba, Zamba2, Qwen3-Next): ``forward(x, gate=None)``, the formula when the
    gate is None, another one with a gate."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * torch.nn.functional.silu(gate)
        x32 = hidden_states.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(hidden_states.dtype)


class WantsTwo(GatedNorm):
    def forward(self, hidden_states, gate):  # the gate required (Qwen3.5's)
        return super().forward(hidden_states, gate)


def test_a_gated_norm_keeps_its_own_forward():
    """Its gate argument made the swapped class's one-input forward raise ``TypeError`` in every forward (gate
    optional), or the probe raise at load (gate required): both keep their own forward now."""
    gated, two = GatedNorm(), WantsTwo()
    assert apply_lean_norm(nn.ModuleList([gated, two])) == 0 and type(gated) is GatedNorm
    x, gate = torch.randn(2, 3, HIDDEN, requires_grad=True), torch.randn(2, 3, HIDDEN)
    gated(x, gate).sum().backward()
    assert x.grad is not None
