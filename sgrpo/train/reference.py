"""The frozen KL reference: the policy as it loaded, stored as small as the policy's own forward allows.

With LoRA the reference is the policy itself with its adapters switched off (``sgrpo.model.lora.adapters_off``):
its base weights are frozen, so no second model is built. Otherwise ``build_reference`` copies the loaded
policy (no second load from disk: one model's host memory less while every process loads), each parameter in
the dtype the policy's forward uses it in at the trainer's precision (``reference_dtypes``):

* ``bf16-true``, ``16-true``, ``64-true``: every parameter in that dtype (the precision plugin converts the
  policy to it);
* ``bf16-mixed``, ``16-mixed``: every ``nn.Linear`` weight but the LM head in the autocast dtype (autocast
  casts the policy's at each use) and, under FSDP2 mixed precision, every parameter of the transformer
  blocks in the dtype they are gathered in (``sgrpo.model.loading.shard_model``); embeddings, the final norm and
  the LM head stay in the policy's dtype (the head is ``sgrpo.model.head``'s, float32 under mixed precision);
* ``32-true``: the policy's dtype.

Its forward is then the initial policy's, number for number: the KL to it starts at 0 exactly, at about half
the bytes under bf16 (Qwen2.5-1.5B: ~3.5 GB instead of 6.2 GB). Under FSDP2 it is sharded as the policy is
(``fully_shard`` per block, no optimiser state), so its forwards are collectives that every process runs in
step, as the policy's are (``sgrpo.train.update``); each process builds only its own shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from sgrpo.distributed import is_sharded
from sgrpo.model.loading import shard_model
from sgrpo.model.lora import adapters_off, has_lora
from sgrpo.rollout.snapshot import copy_weights, plain_shell

#: precision -> the dtype every weight of the policy is converted to
_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
#: precision -> autocast's dtype
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def reference_dtypes(precision: str, gather_dtype: torch.dtype | None = None) -> dict[str, torch.dtype | None]:
    """``plain_shell``'s dtypes for a reference at Lightning ``precision`` ("bf16-mixed", "32-true", ...);
    ``gather_dtype``: the policy's FSDP2 block dtype (``shard_model``'s ``param_dtype``), if any."""
    if precision in _TRUE:
        return {"dtype": _TRUE[precision], "block_dtype": None, "linear_dtype": None}
    if precision in _MIXED:
        return {"dtype": None, "block_dtype": gather_dtype, "linear_dtype": _MIXED[precision]}
    return {"dtype": None, "block_dtype": None, "linear_dtype": None}


def build_reference(
    model: nn.Module, precision: str, gather_dtype: torch.dtype | None = None, mesh=None
) -> nn.Module:
    """A frozen, eval-mode copy of the adapter-free ``model`` on its device, in the dtypes of
    ``reference_dtypes(precision, gather_dtype)``. With ``mesh`` (``model`` is FSDP2-sharded over it), the copy
    is sharded alike while still empty and each process fills its shards from its own: the whole reference is
    never materialised on any process."""
    shell = plain_shell(model, **reference_dtypes(precision, gather_dtype))
    device = next(model.parameters()).device
    if mesh is not None:
        shard_model(shell, mesh)  # on the meta device: FSDP2 shards the empty parameters as it sharded the policy's
    shell.to_empty(device=device)
    if mesh is None:
        shell.tie_weights()  # to_empty gives tied parameters separate storage: tie them again
    with torch.no_grad():
        if mesh is None:
            copy_weights(model, shell)  # buffers too (rotary frequencies are not in the checkpoint)
        else:
            copy_shards(model, shell)
    return shell


def copy_shards(source: nn.Module, target: nn.Module) -> None:
    """Copy each local FSDP2 shard of ``source``'s parameters into ``target``'s (sharded alike: same names, shapes
    and mesh; cast to its dtypes), and every buffer; no collective."""
    params = dict(target.named_parameters())
    for name, param in source.named_parameters():
        params[name].to_local().copy_(param.to_local())
    buffers = dict(target.named_buffers())
    for name, buffer in source.named_buffers():
        buffers[name].copy_(buffer)


@contextlib.contextmanager
def reference_model(policy: nn.Module, reference: nn.Module | None) -> Iterator[nn.Module]:
    """The model whose log-probs the KL is taken against: ``reference``, or with LoRA (no reference built) the
    policy with its adapters off, in eval mode as a built reference is (with ``keep_dropout`` the base model's own
    dropout made the reference's log-probs random; found by a review), each module's mode restored after. A sharded
    reference's root is resharded after use (FSDP2 keeps a root gathered after its forward, for the backward a
    no-grad pass never runs)."""
    if reference is None:
        if not has_lora(policy):
            raise RuntimeError("the loss needs a KL reference and none was built (configure_model)")
        modes = [(module, module.training) for module in policy.modules()]
        policy.eval()
        try:
            with adapters_off(policy):
                yield policy
        finally:
            for module, training in modes:
                module.training = training
        return
    try:
        yield reference
    finally:
        if is_sharded(reference):
            reference.reshard()
