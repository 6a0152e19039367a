"""The policy's weights as an external engine (vLLM) loads them: HF checkpoint names, full tensors, chunks.

Wrapper path components are dropped from names, FSDP2 shards are gathered one tensor at a time (every
process iterates in step), LoRA adapters are merged in, and the tensors are grouped into bounded chunks.
``begin_reload``, ``load_chunk`` and ``end_reload`` load them into a vLLM model so that every kernel sees
them (repacked weights too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from sgrpo.model.lora import plain_weights

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


def engine_weights(
    model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = 0
) -> Iterator[tuple[str, Tensor]]:
    """(HF checkpoint name, full tensor) for each parameter of ``model``, lazily.

    DTensor values (FSDP2 shards, tensor parallelism) are gathered as they are reached, cast to
    ``dtype`` first (the engine's: bf16 gathers half the bytes of float32 master weights) and
    ``bucket_bytes`` at a time (one collective per bucket, ``sgrpo.model.gather``; 0: per tensor):
    collectives, so every process must iterate in step. LoRA adapters are merged into
    their weights (``sgrpo.model.lora.plain_weights``). The output embedding is
    skipped when the input embedding is tied to it (vLLM shares the tensor and ignores it).
    """
    config = getattr(unwrap(model), "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for raw_name, value in plain_weights(model, buffers=False, dtype=dtype, bucket_bytes=bucket_bytes):
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


def as_dtype(weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Floating-point tensors cast to the engine's ``dtype`` (vLLM warns once per tensor it has to cast)."""
    for name, value in weights:
        yield name, value.to(dtype) if value.is_floating_point() else value


def begin_reload(engine_model: nn.Module, vllm_config) -> None:
    """Put a vLLM model's layers in checkpoint form for ``load_chunk`` (vLLM's layerwise reload, >= 0.32).

    Plain ``load_weights`` is not enough: backends re-format weights after loading (vLLM's CPU backend
    packs Linear weights for oneDNN and frees the originals, so ``load_weights`` fails on them, and keeps
    a packed copy of the LM head). The layerwise reload loads each layer in checkpoint form, re-runs its
    ``process_weights_after_loading`` once all its weights are in, and copies the result into the
    tensors the kernels hold. The three steps run under inference mode (the engine's tensors may be
    inference tensors: an engine first built inside a validation).
    """
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with _engine_context(vllm_config):
        initialize_layerwise_reload(engine_model)


def load_chunk(engine_model: nn.Module, chunk: list[tuple[str, Tensor]], vllm_config) -> set[str]:
    """Load one chunk of (HF name, tensor) between ``begin_reload`` and ``end_reload``; the names loaded."""
    with _engine_context(vllm_config):
        return set(engine_model.load_weights(chunk) or ())


def end_reload(engine_model: nn.Module, vllm_config) -> None:
    """Process the layers not processed yet, and re-process tied LM heads.

    A tied head shares the embedding's weight and receives no name of its own, so vLLM processes only
    the embedding: without this the head's packed copy on CPU stays the initial one (a moved embedding
    left the engine's log-probs 7.6 nats mean off the policy's, float32 and bfloat16).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with _engine_context(vllm_config):
        finalize_layerwise_reload(engine_model, vllm_config.model_config)
        for module in tied_modules(engine_model):
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


@contextlib.contextmanager
def _engine_context(vllm_config):
    from vllm.config import set_current_vllm_config

    with torch.inference_mode(), set_current_vllm_config(vllm_config), _quiet(_LAYERWISE_LOGGER, _EXPECTED):
        yield


#: vLLM's layerwise reload warns "<Layer>: Failed to load weights" at every sync for the layers that take no
#: checkpoint name: a tied LM head and RotaryEmbedding (a buffer). ``VLLMRollout`` checks the names itself.
_LAYERWISE_LOGGER, _EXPECTED = "vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights"


@contextlib.contextmanager
def _quiet(logger: str, text: str):
    """Drop the records of ``logger`` whose message contains ``text`` while the block runs."""
    drop = logging.Filter()
    drop.filter = lambda record: text not in record.getMessage()
    logging.getLogger(logger).addFilter(drop)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(drop)


def tied_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose own ``weight`` is the same Parameter as another module's (a tied embedding and LM head)."""
    by_weight: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            by_weight.setdefault(id(weight), []).append(module)
    return [m for group in by_weight.values() if len(group) > 1 for m in group]
