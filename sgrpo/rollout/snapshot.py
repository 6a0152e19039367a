"""A plain copy of the policy's weights for one rollout: gathered once and cast once, not per token.

Under FSDP2 every forward of a sharded block all-gathers its parameters, and under mixed precision
autocast casts each fp32 weight to bf16 again (FSDP2 hands out fresh unsharded tensors, which
autocast's cast cache cannot reuse). A decode step of a few rows is tiny next to that, so decoding
through the sharded model pays one all-gather and one cast per block per token. ``RolloutWeights``
gathers every parameter once at the start of a rollout into an unsharded copy of the model (its
``nn.Linear`` weights already in autocast's dtype, the LM head kept in the model's dtype, since the
sampler's head is float32 like the loss's; under FSDP2 mixed precision every parameter of the blocks in
the dtype they are gathered in), decodes on it without any collective, and frees it after. Same numbers:
autocast, or FSDP2's gather, would have rounded the same weights to the same bf16 values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from sgrpo.distributed import is_sharded
from sgrpo.model.loading import frequency_buffers, transformer_blocks
from sgrpo.model.lora import plain_weights


def plain_class(model: nn.Module) -> type[nn.Module]:
    """The model's own class (FSDP2 swaps in a subclass named ``FSDP<Model>``)."""
    return next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))


class RolloutWeights:
    """Hands out a plain (unsharded, eagerly cast) copy of a model's weights for the length of a rollout.

    ``enabled``: None copies sharded (FSDP2) models only and uses other models as they are; True
    copies every model (its Linear weights cast once when autocast is on); False never copies. The
    copy's module tree is built once (on the meta device, then materialised per rollout) and its
    memory is released when the rollout ends.
    """

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self._shell: nn.Module | None = None
        self._key: tuple | None = None

    def wanted(self, model: nn.Module) -> bool:
        return is_sharded(model) if self.enabled is None else self.enabled

    @contextlib.contextmanager
    def __call__(self, model: nn.Module) -> Iterator[nn.Module]:
        if not self.wanted(model):
            yield model
            return
        device = next(model.parameters()).device
        cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        shell = self._shell_for(model, cast)
        shell.to_empty(device=device)
        shell.tie_weights()  # to_empty gives tied parameters separate storage: tie them again
        try:
            with torch.no_grad():
                copy_weights(model, shell)
            yield shell
        finally:
            shell.to_empty(device="meta")  # the copy's memory goes back before the update

    def _shell_for(self, model: nn.Module, cast: torch.dtype | None) -> nn.Module:
        blocks = getattr(model, "sgrpo_gather_dtype", None) if cast is not None else None
        key = (id(model), cast, blocks)
        if self._shell is None or self._key != key:
            shell = plain_shell(model, linear_dtype=cast, block_dtype=blocks)
            shell.generation_config = model.generation_config
            self._shell, self._key = shell, key
        return self._shell


def plain_shell(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    block_dtype: torch.dtype | None = None,
    linear_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model's own module tree on the meta device (eval mode, frozen), each parameter in the dtype a forward
    of ``model`` uses it in: ``dtype`` (default: the model's), then ``block_dtype`` for every parameter of the
    transformer blocks (FSDP2 mixed precision gathers them in it), then ``linear_dtype`` for every ``nn.Linear``
    but the LM head (autocast casts those at each use; the head is ``sgrpo.model.head``'s, outside autocast). Without
    ``dtype`` every buffer keeps its dtype in ``model`` (the casts above took them along: RoPE's inverse frequencies,
    float32 in a bf16 model, were rounded to bf16, and a 2,048th position's rotation was another); with a half
    ``dtype`` RoPE's frequencies stay float32, as the policy's do through Lightning's conversion."""
    with torch.device("meta"):
        shell = plain_class(model)(model.config).to(dtype or next(model.parameters()).dtype)
    # a given dtype is Lightning's -true conversion, yet to come for the model's buffers too (the reference is built
    # before it), which keeps RoPE's frequencies in float32 when it halves (``keep_frequencies``); otherwise the
    # buffers stay as the model has them
    if dtype is None:
        kept = {n.replace(".base_layer.", "."): b.dtype for n, b in model.named_buffers()}
    else:
        frequencies = {id(b) for _, _, b in frequency_buffers(model)} if dtype.itemsize < 4 else set()
        kept = {n.replace(".base_layer.", "."): torch.float32 for n, b in model.named_buffers() if id(b) in frequencies}
    cast_to_forward_dtypes(shell, block_dtype, linear_dtype, kept)
    return shell.eval().requires_grad_(False)


def cast_to_forward_dtypes(
    model: nn.Module,
    block_dtype: torch.dtype | None = None,
    linear_dtype: torch.dtype | None = None,
    buffers: dict[str, torch.dtype] | None = None,
) -> None:
    """Cast ``model`` in place as ``plain_shell`` casts its shell: every parameter of the transformer blocks to
    ``block_dtype``, then every ``nn.Linear`` but the LM head to ``linear_dtype``, then each buffer named in
    ``buffers`` back to its dtype there (the casts take buffers along). The async producer's model is cast by it
    too, so that it holds every weight in the dtype the synchronous rollout's copy holds it in."""
    if block_dtype is not None:
        for block in transformer_blocks(model):
            block.to(block_dtype)
    if linear_dtype is not None:
        head = model.get_output_embeddings()
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not head:
                module.to(linear_dtype)
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            name = f"{prefix}.{key}" if prefix else key
            if buffer is not None and name in (buffers or {}) and buffer.dtype != buffers[name]:
                module._buffers[key] = buffer.to(buffers[name])


def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Copy every parameter and buffer of ``source`` (gathered when sharded: a collective; LoRA adapters
    merged in) into the plain model ``target``."""
    tensors = dict(target.named_parameters()) | dict(target.named_buffers())
    for name, value in plain_weights(source):
        tensors[name].copy_(value)
