"""The policy's weights as an external engine (vLLM) loads them: HF checkpoint names, full tensors, chunks.

Wrapper path components are dropped from names, FSDP2 shards are gathered one tensor at a time (every
process iterates in step), LoRA adapters are merged in, and the tensors are grouped into bounded chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor, nn

from sgrpo.lora import plain_weights

#: module-path components added by wrappers: torch.compile, FSDP1, activation-checkpoint wrappers
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def hf_parameter_name(name: str) -> str:
    """A trainer parameter name -> the HF checkpoint name vLLM's ``load_weights`` expects.

    Drops the path components that wrappers insert (``_orig_mod`` of torch.compile,
    ``_fsdp_wrapped_module`` of FSDP1, ``_checkpoint_wrapped_module``) and leading ``module.``
    (DDP). FSDP2 (``fully_shard``) keeps the names.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def engine_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(HF checkpoint name, full tensor) for each parameter of ``model``, lazily, one at a time.

    DTensor values (FSDP2 shards, tensor parallelism) are gathered with ``full_tensor()`` as they
    are reached: a collective, so every process must iterate in step. LoRA adapters are merged into
    their weights (``sgrpo.lora.plain_weights``). The output embedding is
    skipped when the input embedding is tied to it (vLLM shares the tensor and ignores it).
    """
    config = getattr(unwrap(model), "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for raw_name, value in plain_weights(model, buffers=False):  # LoRA adapters merged in
        name = hf_parameter_name(raw_name)
        if not (tied and name == "lm_head.weight"):
            yield name, value


def weight_chunks(weights: Iterable[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    chunk: list[tuple[str, Tensor]] = []
    size = 0
    for name, value in weights:
        nbytes = value.numel() * value.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, value))
        size += nbytes
    if chunk:
        yield chunk


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module below DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
