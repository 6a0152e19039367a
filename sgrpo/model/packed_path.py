"""Which packed path a model runs: its attention implementation, whether each group's prompt runs once, and the line
that names them at the start of a run.

``choose_attention`` gives a model on an accelerator the attention the packed path runs best with
(``preferred_attention``: flash-attention's varlen kernel where installed, flex attention where torch has it, SDPA
with a packed mask otherwise). ``sharing_verdict`` says, the same on every process, whether the model can run
``sgrpo.model.packing.pack_shared``'s layout (a block mask: ``sharing_problem``, then a probe,
``shared_packing_problem``), and ``attention_path`` names the path in words.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from sgrpo.distributed import any_process
from sgrpo.model.head import head_dtype
from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.packing import VARLEN_ATTENTION, attention_implementation, shared_pays, sharing_problem

log = logging.getLogger(__name__)

#: torch.compile's recompile limits while flex attention runs: transformers compiles ``flex_attention`` once, and the
#: update calls it with and without gradients, with several mask functions and row counts; at the default limit (8)
#: dynamo gives up and flex runs unfused, materialising every [rows, heads, C, C] score matrix
FLEX_RECOMPILE_LIMIT = 64


def preferred_attention(device_type: str, flash: bool, flex: bool, half: bool = True) -> str | None:
    """The attention implementation packed log-probs run on ``device_type``, or None to keep the model's (SDPA with
    a packed mask): on an accelerator flash-attention's varlen kernel where the ``flash_attn`` package is
    installed (``flash``) and the model computes in half precision (``half``: flash-attention takes no float32),
    else flex attention where torch has it (``flex``: a ``BlockMask`` skips masked blocks); on CPU none (flash does
    not run there, flex needs a C++ compiler and a compile per shape)."""
    if device_type == "cpu":
        return None
    return "flash_attention_2" if flash and half else "flex_attention" if flex else None


def choose_attention(model: nn.Module, device_type: str) -> str | None:
    """Switch ``model`` to ``preferred_attention`` where it still has transformers' default (SDPA) and its class
    supports the switch; returns the implementation it runs. Half precision is read from the LM head's compute dtype
    (``head_dtype``: autocast's where it is on), so call this where the update runs."""
    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    if attention_implementation(model) == "sdpa" and hasattr(model, "set_attn_implementation"):
        half = head_dtype(model.get_output_embeddings().weight).itemsize < 4
        wanted = preferred_attention(device_type, is_flash_attn_2_available(), is_torch_flex_attn_available(), half)
        if wanted is not None:
            with contextlib.suppress(ImportError, ValueError):  # the model's class does not support it: SDPA stays
                use_attention(model, wanted)
    deterministic_flash(model)
    return attention_implementation(model)


def use_attention(model: nn.Module, implementation: str) -> None:
    """Switch ``model`` to attention ``implementation`` (``set_attn_implementation``: ImportError or ValueError where
    its class cannot), with what flex attention needs in this process (``flex_in_autocast_dtype``, dynamo's
    recompile limits raised to ``FLEX_RECOMPILE_LIMIT``) and flash-attention's deterministic backward where asked
    (``deterministic_flash``). The async producer calls it to sample with the attention the trainer's model has."""
    if attention_implementation(model) != implementation:
        model.set_attn_implementation(implementation)
    if implementation == "flex_attention":
        import torch._dynamo

        flex_in_autocast_dtype()
        for name in ("recompile_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), FLEX_RECOMPILE_LIMIT))
    deterministic_flash(model)


def flex_in_autocast_dtype() -> None:
    """Make transformers' ``flex_attention`` take its query, keys and values in autocast's dtype where autocast is on,
    as autocast casts SDPA's (registered once, through ``AttentionInterface.register``).

    Under bf16-mixed the rotary embedding multiplies the bf16 projections by float32 cos and sin, so the query and the
    keys reach the attention in float32 while the values are bf16. Autocast casts all three back for SDPA; flex's
    kernel computes in the query's dtype, and only recent torch (2.13 has it) gives the flex operator an autocast cast
    of its own: without it the packed path's attention ran in float32 on a GPU, slower than the SDPA it replaced."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    current = AttentionInterface._global_mapping.get("flex_attention")
    if getattr(current, "_sgrpo_autocast", False):
        return
    wrapped = current or flex_attention_forward

    def flex_attention_autocast(module, query, key, value, attention_mask, *args, **kwargs):
        kind = query.device.type
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            query, key, value = (x.to(dtype) for x in (query, key, value))
        return wrapped(module, query, key, value, attention_mask, *args, **kwargs)

    flex_attention_autocast._sgrpo_autocast = True
    AttentionInterface.register("flex_attention", flex_attention_autocast)


def deterministic_flash(model: nn.Module) -> None:
    """Under ``trainer.deterministic`` (``torch.use_deterministic_algorithms``), flash-attention's deterministic
    backward: by default it adds dQ with atomics, in an order the GPU's timing sets, and PyTorch's switch cannot see an
    external kernel. transformers reads ``FLASH_ATTENTION_DETERMINISTIC`` at each call; one set by the user stands."""
    if attention_implementation(model) != "flash_attention_2" or not torch.are_deterministic_algorithms_enabled():
        return
    if os.environ.setdefault("FLASH_ATTENTION_DETERMINISTIC", "1") == "1":
        log.info("trainer.deterministic: flash-attention's deterministic backward (FLASH_ATTENTION_DETERMINISTIC)")


def attention_path(model: nn.Module, shares: bool) -> str:
    """The packed path ``model`` runs, in words, for the start-of-run log line."""
    impl = attention_implementation(model)
    if impl in VARLEN_ATTENTION:
        return f"{impl}: the varlen kernel over one packed row (prompts not shared: it takes no block mask)"
    how = {"flex_attention": "flex attention with a BlockMask", "sdpa": "SDPA with a packed mask"}.get(impl, impl)
    rows = "rows of the width a cost model picks"
    return f"{how}, {rows}" + (", each group's prompt once where the cost model says it pays" if shares else "")


def shared_packing_problem(model: nn.Module) -> str | None:
    """Why ``model``'s packed log-probs with each prompt once are wrong, or None; a few small forwards (collectives
    under FSDP2), in eval mode, without gradients.

    A probe of one 24-token prompt with three completions (4, 3 and 2 tokens) in one segment: changing the second
    completion's tokens must leave the other two's log-probs unchanged bit for bit (no completion sees another),
    and the log-probs must be finite and within 1e-4 (0.125 in half precision) of the unshared packed ones.
    """
    weight = model.get_output_embeddings().weight
    tolerance = 0.125 if head_dtype(weight).itemsize < 4 else 1e-4
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(1)  # the probe's ids drawn on the CPU, then moved
    prompt = torch.randint(0, vocab, (1, 24), generator=g, device="cpu").expand(3, -1)
    ids = torch.cat([prompt, torch.randint(0, vocab, (3, 4), generator=g, device="cpu")], 1).to(weight.device)
    attention = torch.ones_like(ids)
    attention[1, -1:] = attention[2, -2:] = 0
    completion = attention[:, 24:].bool()
    changed = ids.clone()
    changed[1, 24:] = (ids[1, 24:] + 1) % vocab
    if not shared_pays(attention, completion, ids, getattr(model.config, "hidden_size", None)):
        return None  # the model's hidden size makes even this layout not pay: completion_logprobs never shares
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            shared, other, alone = (
                completion_logprobs(model, x, attention, completion, packing=True, share_prompts=share)[0]
                for x, share in ((ids, True), (changed, True), (ids, False))
            )
    finally:
        model.train(training)
    impl = attention_implementation(model)
    if not torch.equal(shared[[0, 2]], other[[0, 2]]):
        return f"with {impl} attention, one completion's log-probs change with another's tokens under the block mask"
    gap = float((shared - alone).abs().max())
    if not gap <= tolerance:  # NaN fails too
        return f"with {impl} attention, log-probs with the prompt once differ from unshared ones by {gap:.3g}"
    return None


def sharing_verdict(model: nn.Module, device: torch.device) -> str | None:
    """Why packed log-probs cannot run each group's prompt once on some process (``sharing_problem``, then
    ``shared_packing_problem``), or None: the same answer on every process. A check that raises (a kernel refusing
    the block mask) is a failed check: packed rows without sharing."""
    problem = sharing_problem(model)
    if problem is None:
        try:
            problem = shared_packing_problem(model)
        except Exception as err:
            problem = f"the check raised {type(err).__name__}: {err}"
    if any_process(problem is not None, device):
        return problem or "the check failed on another process"
    return None
