"""VLLMRollout's data on CPU without vLLM (split from tests/test_vllm_rollout.py, which keeps TIS and the engine's
call sequence): requests from examples, vLLM-shaped outputs converted to a batch, and the weights the engine is sent
(parameter names, tied and untied heads, FSDP2 shards gathered, chunks of bounded bytes). vLLM's outputs are
mirrored by the stand-ins of ``tests/vllm_fakes.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import HFRollout
from sgrpo.rollout.vllm_requests import prompt_token_ids, rollout_batch_from_outputs, sampling_kwargs
from sgrpo.rollout.weightsync import engine_weights, hf_parameter_name, weight_chunks
from sgrpo.types import Example
from tests.gloo_pair import one_process_group
from tests.test_vllm_rollout import model_dir as model_dir  # the module's tiny model (a fixture)
from tests.test_vllm_rollout import tokenizer as tokenizer  # a fixture
from tests.vllm_fakes import (
    EOS,
    PAD,
    completion,
    request,
)


# ---------------------------------------------------------------------------------------------- requests
def test_prompt_ids_are_hf_rollouts_ids_and_sampling_kwargs(tokenizer):
    examples = [Example(prompt="s:31=", answer="13"), Example(prompt="s:4=", answer="4")]
    assert prompt_token_ids(tokenizer, examples) == [[16, 15, 6, 4, 14], [16, 15, 7, 14]]  # no <bos> added
    common = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop_token_ids": (EOS,)}
    assert sampling_kwargs(group_size=4, seed=11, **common) == {
        "n": 4, "max_tokens": 8, "stop_token_ids": [EOS], "logprobs": 0,
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11,
    }  # fmt: skip
    # greedy: one argmax completion per prompt (the conversion repeats it G times), no seed, no top-k/top-p
    assert sampling_kwargs(group_size=4, greedy=True, seed=11, **common) == {
        "n": 1, "max_tokens": 8, "stop_token_ids": [EOS], "logprobs": 0, "temperature": 0.0,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- outputs
def two_requests():
    """Prompt A = ids [4, 5, 6] ("123"), prompt B = [7] ("4"); G = 2, completions listed out of index order."""
    a = request([4, 5, 6], [completion(1, [9, 9, 9], [-1.0, -2.0, -3.0], "length", "666"),
                            completion(0, [8, EOS], [-0.5, -0.1], "stop", "5")])  # fmt: skip
    b = request([7], [completion(0, [EOS], [-0.2], "stop", ""), completion(1, [10, 11, EOS], [-0.3] * 3, "stop", "78")])
    return [a, b]


def test_outputs_become_a_left_and_right_padded_batch(tokenizer):
    batch = rollout_batch_from_outputs(two_requests(), group_size=2, pad_id=PAD, tokenizer=tokenizer)
    # P = 3 (longest prompt), T = 3 (longest completion); rows b*G+g with g = CompletionOutput.index
    assert batch.input_ids.tolist() == [
        [4, 5, 6, 8, EOS, PAD],
        [4, 5, 6, 9, 9, 9],
        [PAD, PAD, 7, EOS, PAD, PAD],
        [PAD, PAD, 7, 10, 11, EOS],
    ]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6, [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.completion_mask.tolist() == [[True, True, False], [True] * 3, [True, False, False], [True] * 3]
    assert batch.truncated.tolist() == [False, True, False, False]  # finish_reason == "length"
    assert batch.completions == ["5", "666", "", "78"]  # decoded without <eos>
    assert batch.logprobs.dtype == torch.float32
    expected = torch.tensor([[-0.5, -0.1, 0.0], [-1.0, -2.0, -3.0], [-0.2, 0.0, 0.0], [-0.3] * 3])  # 0 on padding
    torch.testing.assert_close(batch.logprobs, expected, atol=1e-8, rtol=1e-5)
    assert batch.group_size == 2 and batch.prompt_length == 3 and batch.num_groups == 2


def test_outputs_without_tokenizer_or_logprobs_and_greedy_groups():
    requests = [request([4], [completion(0, [8, EOS], None, "stop", "5")])]  # greedy: n = 1 fills the group
    batch = rollout_batch_from_outputs(requests, group_size=3, pad_id=PAD)
    assert batch.completions == ["5", "5", "5"] and batch.logprobs is None
    assert batch.input_ids.tolist() == [[4, 8, EOS]] * 3
    with pytest.raises(ValueError, match="2 completions for a group of 3"):
        rollout_batch_from_outputs([request([4], [completion(i, [8], None, "stop") for i in range(2)])], 3, PAD)


def test_conversion_reproduces_hf_rollouts_batch(model_dir):
    """HFRollout's rows re-expressed as vLLM outputs convert back to the same tensors and texts."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = build_char_tokenizer()
    examples = [Example(prompt="s:9175=", answer="1579"), Example(prompt="s:31=", answer="13")]
    torch.manual_seed(0)
    hf = HFRollout(max_new_tokens=6).generate(model, tokenizer, examples, group_size=3)
    p, requests = hf.prompt_length, []
    for b in range(2):
        rows = range(3 * b, 3 * b + 3)
        prompt = hf.input_ids[3 * b, :p][hf.attention_mask[3 * b, :p].bool()].tolist()
        outs = [
            completion(g, hf.input_ids[r, p:][hf.completion_mask[r]].tolist(), None,
                       "length" if hf.truncated[r] else "stop")
            for g, r in enumerate(rows)
        ]  # fmt: skip
        requests.append(request(prompt, outs))
    batch = rollout_batch_from_outputs(requests, group_size=3, pad_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    for field in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(batch, field), getattr(hf, field)), field
    assert batch.completions == hf.completions


# ---------------------------------------------------------------------------------------------- weights
def test_hf_parameter_names_drop_wrapper_components():
    assert hf_parameter_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_parameter_name("module.model.norm.weight") == "model.norm.weight"  # DDP
    assert hf_parameter_name("_orig_mod.model.norm.weight") == "model.norm.weight"  # torch.compile
    assert hf_parameter_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert (
        hf_parameter_name("_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w")
        == "model.layers.1.mlp.w"
    )  # FSDP1 + activation checkpointing


def test_engine_weights_of_a_tied_model_skip_lm_head_and_see_through_wrappers(tokenizer):
    model = build_tiny_llama(tokenizer)  # tie_word_embeddings=True
    state = model.state_dict()
    assert "lm_head.weight" in state  # the tied alias is in the state dict; vLLM shares the tensor instead
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}

    class DDPLike(nn.Module):  # DistributedDataParallel's naming: the model under ``module``
        def __init__(self, module):
            super().__init__()
            self.module = module

    for wrapped in (model, DDPLike(model), torch.compile(model), DDPLike(torch.compile(model))):
        got = dict(engine_weights(wrapped))
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_engine_weights_of_an_untied_model_include_lm_head(tokenizer):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    names = [name for name, _ in engine_weights(model)]
    assert names == list(model.state_dict()) and "lm_head.weight" in names


def test_engine_weights_gather_fsdp2_shards(tokenizer):
    """FSDP2 parameters are DTensors: each is gathered with full_tensor() (one process, gloo)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_process_group():
        model = build_tiny_llama(tokenizer)
        expected = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(hasattr(p, "full_tensor") for p in model.parameters())
        got = dict(engine_weights(model))
        assert got.keys() == expected.keys()
        assert all(type(v) is torch.Tensor and torch.equal(v, expected[k]) for k, v in got.items())
        # in the engine's dtype and in buckets: one collective per bucket, moving bf16 bytes
        name = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
        gathers, real = [], getattr(torch.distributed, name)
        record = lambda out, inp, group=None: gathers.append(out.nbytes) or real(out, inp, group)  # noqa: E731
        setattr(torch.distributed, name, record)
        try:
            one_bucket = dict(engine_weights(model, torch.bfloat16, bucket_bytes=2**30))
            full_bytes = sum(v.numel() for v in expected.values()) * 2
            assert gathers == [full_bytes]  # all parameters, half their float32 bytes, one collective
            assert all(torch.equal(one_bucket[k], v.to(torch.bfloat16)) for k, v in expected.items())
            gathers.clear()
            small = dict(engine_weights(model, torch.bfloat16, bucket_bytes=full_bytes // 3))
            assert 3 <= len(gathers) < len(expected) and sum(gathers) == full_bytes
            assert all(torch.equal(small[k], v.to(torch.bfloat16)) for k, v in expected.items())
        finally:
            setattr(torch.distributed, name, real)


def test_weight_chunks_bound_bytes():
    pairs = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1])]  # float32: 40, 40, 120, 20, 4 B
    chunks = [[name for name, _ in chunk] for chunk in weight_chunks(pairs, max_bytes=80)]
    assert chunks == [["w0", "w1"], ["w2"], ["w3", "w4"]]  # 80 | 120 (alone: larger than the bound) | 24
