"""Loading and placing the policy model: local folders or hub ids, and FSDP2 sharding."""

from __future__ import annotations

from pathlib import Path

import torch


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules of the classes it names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: torch.nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 ``fully_shard`` each transformer block (``model._no_split_modules``), then the root.

    With ``param_dtype`` (bf16 under bf16-mixed) the blocks are gathered and computed in it and their
    gradients reduce-scattered in float32 (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``): half
    the bytes of an fp32 gather, no autocast re-cast of each gathered block, float32 master weights and
    optimiser state. Under autocast the blocks' inputs are not cast (``cast_forward_inputs=False``), so the
    residual stream stays in float32 as under autocast alone; outside autocast (a forward of one's own after
    fit) they are, or the blocks' matmuls would mix dtypes. The root (embeddings, final norm, LM head) is
    gathered in the model's dtype: the LM head the sampler and the loss share (``sgrpo.model.head``).
    ``model.sgrpo_gather_dtype`` records ``param_dtype`` for the rollout's weight snapshot and the KL
    reference (``sgrpo.rollout.snapshot``, ``sgrpo.train.reference``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer blocks (_no_split_modules) to shard")
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in blocks:
        fully_shard(block, mesh=mesh, **({"mp_policy": mixed} if param_dtype is not None else {}))
        if param_dtype is not None:
            block.register_forward_pre_hook(_inputs_cast_outside_autocast(param_dtype), with_kwargs=True)
    fully_shard(model, mesh=mesh)
    model.sgrpo_gather_dtype = param_dtype


def _inputs_cast_outside_autocast(dtype: torch.dtype):
    """A forward pre-hook casting a module's floating-point inputs to ``dtype`` unless autocast is on.

    An additive attention mask (eager attention's: float32's least value where masked) is cast with its masked
    entries at ``dtype``'s least finite value: cast as it is, float32's least rounds to -inf in bf16, a left-padded
    row's pad positions see only -inf and their softmax is NaN, which reached the real tokens through their keys
    and values (found by a review)."""
    from torch.utils._pytree import tree_map

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(module, args, kwargs):
        device = next(module.parameters()).device.type
        if torch.is_autocast_enabled(device):
            return None
        kwargs = tree_map(cast, kwargs)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            kwargs["attention_mask"] = mask.clamp_min(torch.finfo(dtype).min)
        return tree_map(cast, args), kwargs

    return hook


def resolve_model_path(path: str) -> str:
    """A local folder (relative to the working directory or to the sgrpo checkout, two levels above this file), else
    a hub id."""
    for candidate in (Path(path).expanduser(), Path(__file__).resolve().parents[2] / path):
        if candidate.is_dir():
            return str(candidate)
    return path


#: bytes a CPU weight's address is aligned to after ``load_causal_lm``: torch's own CPU allocations' alignment
WEIGHT_ALIGNMENT = 64


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` for a model that computes on ``device``: with every
    weight in memory of its own where that is the CPU (``own_weights``). Where it is an accelerator the weights are
    left in the file's map, which the processes of a machine share until each moves its model there (a private copy
    on every process first would take N models' worth of host memory at once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if torch.device(device).type == "cpu":
        own_weights(model)
    return model


def own_weights(model: torch.nn.Module) -> int:
    """Copy each CPU parameter and buffer whose address is not ``WEIGHT_ALIGNMENT``-aligned into memory of its own
    (torch's allocator aligns it); returns how many moved. Tied parameters stay tied (one ``Parameter`` each).

    transformers (5.x) maps a safetensors file and hands out its tensors without a copy, at the file's offsets:
    8-byte aligned. The CPU BLAS computes a one-row product (a decode step with one row left, a one-row
    micro-batch) in another order for such a weight than for an aligned copy, so the same weights gave other
    sampling log-probs in a copy (the FSDP2 rollout's ``RolloutWeights``, the KL reference, the async producer's
    model) than in the loaded model: the last bits of one token's log-prob, enough to break staleness 0's
    bit-for-bit equality with the synchronous run on some CPUs (AMD EPYC). With every weight aligned the
    products are the same wherever the weights live; unaligned weights also made large one-row products slower.
    The copies are private to the process (the map's pages are shared): ``load_causal_lm`` makes them on the CPU only.
    """
    moved = 0
    with torch.no_grad():
        for param in model.parameters():  # deduplicated: a tied weight is one Parameter, moved once
            if param.device.type == "cpu" and param.data_ptr() % WEIGHT_ALIGNMENT:
                param.data = param.data.clone(memory_format=torch.contiguous_format)
                moved += 1
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type == "cpu" and buffer.data_ptr() % WEIGHT_ALIGNMENT:
                    module._buffers[key] = buffer.clone(memory_format=torch.contiguous_format)
                    moved += 1
    return moved


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0: ``nn.Dropout`` modules, attention-dropout rates that
    modules keep, and the rates of the configs they read in forward (Falcon's ``hidden_dropout`` and
    ``attention_dropout``; any float config field named ``*dropout*``, ``*pdrop*`` or ``layerdrop``).

    RL on a policy's own samples needs the trained log-probs to be the sampling ones: with dropout
    on in training the on-policy ratio is not 1 (TRL and verl turn it off too). Returns how many
    modules and config fields changed.
    """
    changed = 0
    configs = {id(c): c for m in model.modules() for c in (getattr(m, "config", None),) if hasattr(c, "to_dict")}
    for config in list(configs.values()):
        configs |= {id(sub): sub for sub in vars(config).values() if hasattr(sub, "to_dict")}  # text/vision configs
    for config in configs.values():
        for name, value in list(vars(config).items()):
            if any(key in name for key in ("dropout", "pdrop", "layerdrop")) and isinstance(value, float) and value:
                setattr(config, name, 0.0)
                changed += 1
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p, changed = 0.0, changed + 1
        for name, value in list(vars(module).items()):  # e.g. attention_dropout: a float read in forward
            if "dropout" in name and isinstance(value, float) and value:
                setattr(module, name, 0.0)
                changed += 1
    return changed


def largest_magnitude(tensors) -> torch.Tensor:
    """max |x| over all ``tensors`` (over all shards under FSDP2): finite iff every entry is (no sum to overflow)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.zeros((), device="cpu")  # nothing to check: finite
    norm = torch.nn.utils.get_total_norm(tensors, norm_type=float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def frequency_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """The float32 buffers no checkpoint holds (non-persistent: RoPE's inverse frequencies), as (module, name,
    tensor). transformers computes them in float32 whatever dtype it loads a model in, and vLLM rotates in float32
    too, so a conversion to half precision keeps them (``keep_frequencies``)."""
    return [(module, key, buffer) for module in model.modules() for key, buffer in module._buffers.items()
            if buffer is not None and buffer.dtype == torch.float32
            and key in module._non_persistent_buffers_set]  # fmt: skip


def keep_frequencies(kept: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> None:
    """Put back each of ``frequency_buffers``' buffers that a conversion since turned to half precision, in float32
    on the device it is on now: Lightning's ``bf16-true`` (``module.to(bfloat16)``) rounded RoPE's inverse
    frequencies, so the trained policy rotated positions otherwise than its export and vLLM (logits 0.008 apart on a
    tiny model at 60 positions; a KL of 0.2-0.3 past 1,000 positions at Qwen2.5's RoPE; found by a review)."""
    for module, key, original in kept:
        now = module._buffers.get(key)
        if now is not None and now.is_floating_point() and now.dtype.itemsize < 4:
            module._buffers[key] = original.to(now.device)


def to_dtype_keeping_frequencies(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` as Lightning's ``-true`` precisions convert it, RoPE's frequencies kept
    (``keep_frequencies``)."""
    kept = frequency_buffers(model)
    model.to(dtype)
    keep_frequencies(kept)
    return model
