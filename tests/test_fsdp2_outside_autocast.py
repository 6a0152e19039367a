"""FSDP2 with bf16 blocks (``shard_model``'s ``param_dtype``, bf16-mixed) and a forward of one's own outside
autocast: the blocks' inputs are cast to bf16, and eager attention's additive mask with them."""

from __future__ import annotations

import torch

from sgrpo.model.loading import shard_model
from sgrpo.model.tiny import SYNTHETIC_CHARS, build_char_tokenizer, build_tiny_llama
from tests.gloo_pair import one_process_group


def test_a_left_padded_row_stays_finite_with_eager_attention_outside_autocast():
    """float32's least value, which marks eager attention's masked entries, rounds to -inf in bf16: a left-padded
    row's pad positions saw only -inf, their softmax was NaN, and the real tokens read it through their keys and
    values (NaN logits; found by a review). SDPA's boolean mask never had it."""
    from torch.distributed.device_mesh import init_device_mesh

    with one_process_group():
        torch.manual_seed(0)
        model = build_tiny_llama(build_char_tokenizer(SYNTHETIC_CHARS)).eval()
        model.set_attn_implementation("eager")
        ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11]])
        attention = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=attention).logits
        shard_model(model, init_device_mesh("cpu", (1,)), torch.bfloat16)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits
        assert torch.isfinite(logits).all()
        real = attention.bool()
        assert (logits[real] - plain[real]).abs().max() < 0.1  # bf16 blocks: the float32 model's logits, rounded
