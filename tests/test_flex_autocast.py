"""Flex attention under bf16-mixed gets its query, keys and values in autocast's dtype (``flex_in_autocast_dtype``),
as autocast gives SDPA: found by a review, its effect a GPU's (flex's Triton kernel computes in the query's dtype, so
the packed path's attention ran in float32 there); checked here on the CPU, where flex's forward runs too."""

from __future__ import annotations

import pytest
import torch

from sgrpo.model.logprobs import completion_logprobs
from tests.test_packing_shared import tiny


@pytest.fixture
def flex_calls(monkeypatch):
    """The dtypes of (query, key, value) at each flex call, on the eager kernel; transformers' registry restored."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import transformers.integrations.flex_attention as integration
    from torch.nn.attention.flex_attention import flex_attention
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention",
                        AttentionInterface._global_mapping["flex_attention"])  # fmt: skip
    calls: list[tuple[torch.dtype, ...]] = []

    def eager(query, key, value, training=False, **kwargs):  # no compile: one CPU forward is all this needs
        calls.append((query.dtype, key.dtype, value.dtype))
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "compile_friendly_flex_attention", eager)
    return calls


def test_flex_chosen_under_bf16_mixed_computes_in_bf16_like_sdpa(flex_calls):
    from sgrpo.model.packed_path import choose_attention

    model = tiny("sdpa")
    ids = torch.randint(3, 17, (2, 12), generator=torch.Generator().manual_seed(0))
    attention, completion = torch.ones_like(ids), torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert choose_attention(model, "cuda") == "flex_attention"  # what a GPU without flash-attention gets
        flex = completion_logprobs(model, ids, attention, completion, packing=True)[0]
        model.set_attn_implementation("sdpa")
        sdpa = completion_logprobs(model, ids, attention, completion, packing=True)[0]
    assert flex_calls and set(flex_calls) == {(torch.bfloat16,) * 3}  # the rotary's float32 query and keys: cast
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=0.02)  # both attentions in bf16
    flex_calls.clear()
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():  # no autocast: float32 throughout, nothing cast
        completion_logprobs(model, ids, attention, completion, packing=True)
    assert set(flex_calls) == {(torch.float32,) * 3}


def test_the_cast_is_registered_once(flex_calls):
    from transformers import AttentionInterface

    from sgrpo.model.packed_path import flex_in_autocast_dtype

    flex_in_autocast_dtype()
    first = AttentionInterface._global_mapping["flex_attention"]
    flex_in_autocast_dtype()
    assert AttentionInterface._global_mapping["flex_attention"] is first and first._sgrpo_autocast


