"""LoRA through the ``peft`` library: adapters injected into the model itself, merged wherever weights leave it.

``LoRA`` is the ``model.peft`` block of a config. ``apply_lora`` injects LoRA layers into the loaded model
in place (``peft.inject_adapter_in_model``: the model keeps its own class, so the decoder, FSDP2 sharding
and the LM head work as for full fine-tuning) and freezes everything else: only the adapters get
gradients and optimiser state. Sampling runs through the adapted layers (adapter-aware), or on weights
with the adapters merged in (``plain_weights``: ``W + scaling * B @ A``) where weights are copied out:
the rollout's weight snapshot and the vLLM engine. Checkpoints hold the adapters (the base is the model
folder), and the export writes a PEFT adapter folder and, on request, the merged model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from sgrpo.model.gather import gathered

ADAPTER = "default"


@dataclass
class LoRA:
    """LoRA settings (``model.peft``).

    Args:
        rank: Rank r of each adapter.
        alpha: Scaling numerator: the update is alpha / r * B A.
        dropout: Dropout on the adapters' input (needs model.keep_dropout: training turns dropout off otherwise).
        target_modules: Linear modules adapted: "all-linear" (every Linear but the LM head) or names ([q_proj, v_proj]).
        export_merged: Also write the merged model to ``<export>/merged`` at the end of fit.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    export_merged: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"peft: need rank >= 1, alpha > 0, 0 <= dropout < 1; got {self.rank}, {self.alpha}, "
                             f"{self.dropout}")  # fmt: skip

    def config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, task_type="CAUSAL_LM")  # fmt: skip


def apply_lora(model: nn.Module, spec: LoRA) -> nn.Module:
    """Inject LoRA layers into ``model`` in place and freeze every other parameter. Raises ``ValueError`` naming
    ``model.peft.target_modules`` where no module matches, or where one is not a linear layer (``nn.Linear``, or
    GPT-2's transposed ``Conv1D``): an embedding's or convolution's adapters are not merged into its weight; or
    where one is the LM head, whose weight the loss and the sampler read directly."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear

    try:
        inject_adapter_in_model(spec.config(), model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's "Target modules ... not found in the base model"
        raise ValueError(f"model.peft.target_modules={spec.target_modules!r} adapts nothing: {err}") from None
    others = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
              if hasattr(module, "base_layer") and not isinstance(module, Linear)]  # fmt: skip
    if others:
        raise ValueError(f"model.peft.target_modules={spec.target_modules!r} adapts {', '.join(others[:3])}: only "
                         f"linear layers take adapters here; name linear modules (q_proj, v_proj, ...) or all-linear")
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "base_layer"):  # the loss and the sampler read the head's weight itself
        name = next(name for name, module in model.named_modules() if module is head)
        raise ValueError(f"model.peft.target_modules={spec.target_modules!r} adapts the LM head ({name}): its "
                         f"log-probs are computed from the head's weight (sgrpo.model.head), so the adapters would "
                         f"never train; leave {name} out (all-linear does)")  # fmt: skip
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def lora_problem(spec: LoRA, keep_dropout: bool, model_path: str) -> str | None:
    """Why the ``model.peft`` block cannot train as written, in one line naming the field, or None; checked before
    any weight loads: a dropout that ``disable_dropout`` would zero (every dropout is off in training unless
    ``model.keep_dropout``), and target modules that adapt nothing or not a linear layer (``apply_lora`` on the
    model built from its config on the meta device; a config that does not read is the model loader's to report)."""
    if spec.dropout > 0 and not keep_dropout:
        return (f"model.peft.dropout={spec.dropout:g} would be set to 0: dropout is off in training (the trained "
                f"policy is the sampled one) unless model.keep_dropout=true; set one of the two")  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM

    from sgrpo.model.loading import resolve_model_path

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model_path))
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError):
        return None
    try:
        apply_lora(skeleton, spec)
    except ValueError as err:
        return str(err).splitlines()[0]
    return None


def peft_mismatch(trained: dict | None, spec: LoRA | None) -> str | None:
    """Why a checkpoint trained with the LoRA settings ``trained`` (its record's ``peft``: None without LoRA) cannot
    be evaluated with ``spec``, in words that follow its path, or None. Rank, alpha and target modules make the
    adapters: others than the checkpoint's dropped adapters or rescaled them without a word (loading is not strict
    under LoRA); dropout and ``export_merged`` do not. A list of target modules is a set (PEFT matches each module
    against all of them): the same names in another order make the same adapters."""
    if (trained is None) != (spec is None):
        trained_with = "with LoRA adapters" if trained else "without LoRA"
        return f"was trained {trained_with}; give model.peft as the run's config does"
    if trained is None:
        return None
    ours, keys = asdict(spec), ("rank", "alpha", "target_modules")
    differ = [f"model.peft.{key}={trained[key]!r} (this config: {ours[key]!r})"
              for key in keys if key in trained and _compared(trained[key]) != _compared(ours[key])]
    return f"was trained with {', '.join(differ)}; give model.peft as the run's config does" if differ else None


def _compared(value):
    """``value`` as compared: a list (or tuple, set) of module names as a set; a string (all-linear, or a regex
    PEFT matches whole names against) or a number as it is."""
    return frozenset(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every LoRA layer's adapters off (each computes its base layer alone), as ``PeftModel``'s
    ``disable_adapter()`` does, for a model whose adapters ``apply_lora`` injected; on again after, trainable."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def plain_weights(
    model: nn.Module, buffers: bool = True, dtype: torch.dtype | None = None, bucket_bytes: int = 0
) -> Iterator[tuple[str, Tensor]]:
    """The model's parameters (and buffers) under its plain (adapter-free) names, adapters merged in
    (``W + scaling * B @ A``), gathered from FSDP2 shards (collectives: every process must iterate in step).

    ``dtype``: floating-point parameters are cast to it before they are gathered (bf16 halves the bytes),
    an adapted weight after its merge (its base weight and adapters travel in their own dtypes);
    ``bucket_bytes``: tensors gathered together up to that many bytes (``sgrpo.model.gather``; 0: one by one).
    """
    adapted = {name: module for name, module in model.named_modules() if hasattr(module, "base_layer")}

    def items():
        for name, param in model.named_parameters():
            if is_adapter(name):
                continue
            owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            if owner in adapted and name.endswith(".base_layer.weight"):
                layer = adapted[owner]
                yield ("W", owner), param, None
                yield ("A", owner), layer.lora_A[ADAPTER].weight, None
                yield ("B", owner), layer.lora_B[ADAPTER].weight, None
            else:
                yield ("", name.replace(".base_layer.", ".")), param, dtype if param.is_floating_point() else None

    parts: dict[str, Tensor] = {}
    for (kind, name), value in gathered(items(), bucket_bytes):
        if not kind:
            yield name, value
        elif kind != "B":
            parts[kind] = value
        else:  # the base weight, A, B of one adapted layer are consecutive
            w, a, scaling = parts.pop("W"), parts.pop("A"), adapted[name].scaling[ADAPTER]
            delta = value.float() @ a.float()  # [out, in]; GPT-2's Conv1D keeps its weight as [in, out]
            merged = w + (delta.T if adapted[name].fan_in_fan_out else delta).to(w.dtype) * scaling
            yield f"{name}.weight", merged if dtype is None else merged.to(dtype)
    for name, buffer in model.named_buffers() if buffers else ():
        yield name.replace(".base_layer.", "."), buffer


def plain_layout(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor ``plain_weights(model, buffers=False)`` yields, in its order, without
    gathering anything: an FSDP2 parameter's shape is its whole tensor's, and an adapted layer's merged weight has
    its base weight's dtype and shape. What a buffer for the gathered weights needs before the first is gathered."""
    adapted = {name for name, module in model.named_modules() if hasattr(module, "base_layer")}
    layout = []
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        plain = f"{owner}.weight" if owner in adapted and name.endswith(".base_layer.weight") else name
        layout.append((plain.replace(".base_layer.", "."), param.dtype, tuple(param.shape)))
    return layout


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' weights, gathered (a collective under FSDP2), under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``), on the CPU."""
    state = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            value = param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()
            state["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = value.cpu()
    return state


def save_adapter(state: dict[str, Tensor], spec: LoRA, base: str, path: Path) -> None:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``): ``PeftModel.from_pretrained``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = spec.config()
    config.base_model_name_or_path = base
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "adapter_model.safetensors")
    (path / "sgrpo_lora.json").write_text(json.dumps(asdict(spec)))


def merged_state(model: nn.Module, keep: bool = True) -> dict[str, Tensor]:
    """A full, adapter-free state dict (adapters merged) on the CPU: what ``save_pretrained`` of the merged
    model would hold. Under FSDP2 every process must call this (each tensor is gathered, a collective); only
    one that ``keep``s holds the copies (the others get ``{}``: a 7B model is 28 GB of host memory per process)."""
    state = {}
    for name, tensor in plain_weights(model):
        if keep and not _non_persistent(model, name):
            state[name] = tensor.detach().cpu()
    return state


def _non_persistent(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf in getattr(module, "_non_persistent_buffers_set", ())
