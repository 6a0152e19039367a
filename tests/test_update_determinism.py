"""The update's forward and backward run no op that PyTorch computes in a thread-timed order on a CPU.

``index_put`` with ``accumulate=True`` (the backward of ``x[index]``) adds with parallel atomic adds on a CPU with more
than one thread: where an index repeats, the sum's order (hence its last bits) follows how the threads were scheduled.
A shared prompt's last hidden state is gathered once per completion (duplicates), so a gather by ``[index]`` made a
quickstart run on a loaded machine end on other weights (48.3% vs 44.5-46.0% after 200 steps) although every step
was seeded; ``index_select`` (backward: ``index_add_``, serial over the index) does not.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sgrpo.model.logprobs as logprobs
from sgrpo.model.logprobs import completion_logprobs
from tests.test_packing_shared import grouped_batch, tiny

#: the ops PyTorch documents as thread-order dependent on a CPU when they accumulate into one place more than once
ACCUMULATING = {"index_put", "index_put_", "_index_put_impl_"}


def _repeats(indices) -> bool:
    """Whether ``index_put``'s indices name one place more than once (a boolean mask never does)."""
    if any(i is not None and i.dtype == torch.bool for i in indices):
        return False
    used = torch.broadcast_tensors(*[i for i in indices if i is not None])
    places = torch.stack([i.reshape(-1) for i in used], -1)
    return torch.unique(places, dim=0).shape[0] < places.shape[0]


class AccumulatingOps(TorchDispatchMode):
    """Records each ``index_put`` run under it (forward and backward) that adds into one place more than once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in ACCUMULATING:
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
            if accumulate and _repeats(args[1]):
                self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("packing", [True, False])
def test_a_shared_prompts_update_accumulates_no_gradient_in_a_thread_timed_order(monkeypatch, packing):
    monkeypatch.setattr(logprobs, "shared_pays", lambda *args: True)  # share even this small batch's prompts
    shared = []
    original = logprobs.pack_shared
    monkeypatch.setattr(logprobs, "pack_shared", lambda *a: shared.append(original(*a)) or shared[-1])
    model = tiny()
    ids, mask, completion = grouped_batch(groups=3, g=4)
    with AccumulatingOps() as ops:
        logp, entropy = completion_logprobs(model, ids, mask, completion, 0.7, with_entropy=True, packing=packing)
        (logp.sum() + entropy.sum()).backward()
    if packing:  # the prompts were shared, and a prompt's last state was gathered once per completion
        assert len(shared) == 1 and shared[0].hidden_index.unique().numel() < shared[0].hidden_index.numel()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert ops.seen == []


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device, op", [("cpu", "index_select"), ("meta", "index")])
def test_gather_rows_takes_the_gather_whose_backward_is_ordered_on_its_device(device, op):
    # CPU: index_select (backward index_add_, serial over the index); elsewhere (CUDA: index_add_ is atomic) x[index]
    x = torch.arange(12.0).view(4, 3).to(device)
    index = torch.tensor([2, 0, 2, 3], device=device)
    with OpNames() as ops:
        rows = logprobs.gather_rows(x, index)
    assert op in ops.names and rows.shape == (4, 3)
    if device == "cpu":
        assert torch.equal(rows, x[index])


def test_trainer_deterministic_asks_flash_attention_for_its_deterministic_backward(monkeypatch):
    from sgrpo.model.packed_path import deterministic_flash

    model = tiny("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    deterministic_flash(model)  # deterministic algorithms off: flash's default (atomics) left alone
    assert "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    deterministic_flash(model)
    assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")  # the user's own setting stands
    deterministic_flash(model)
    assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "0"
    model.config._attn_implementation = "sdpa"
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC")
    deterministic_flash(model)
    assert "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
