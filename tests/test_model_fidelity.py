"""The trained log-probs are the model's own: logit transforms, dropout, and sampling the loss can model."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from estimators import GRPO
from sgrpo.model.head import LogitTransform, check_logit_head
from sgrpo.model.loading import disable_dropout
from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from tasks.synthetic import SyntheticTask

SMALL = dict(
    vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
#: models whose forward transforms h W^T: soft-capping at 2 (Gemma 2 uses 30 on logits of that size),
#: Granite's division by logits_scaling, Cohere's logit_scale
TRANSFORMING = {
    "gemma2_softcap": (Gemma2ForCausalLM, Gemma2Config, {"final_logit_softcapping": 2.0, "head_dim": 8}),
    "granite_scaling": (GraniteForCausalLM, GraniteConfig, {"logits_scaling": 4.0}),
    "cohere_scale": (CohereForCausalLM, CohereConfig, {"logit_scale": 0.25}),
}


def build(name: str) -> torch.nn.Module:
    cls, config_cls, extra = TRANSFORMING[name]
    torch.manual_seed(0)
    model = cls(config_cls(**SMALL, **extra)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # logits of a few units, where the transforms bite
    return model


@pytest.mark.parametrize("name", sorted(TRANSFORMING))
def test_logprobs_and_gradients_follow_the_models_logit_transform(name):
    """sgrpo's chunked head (hand-written backward) against autograd through the model's own logits at
    temperature 0.7: log-probs and every parameter's gradient. Without the transform the log-prob error
    was 15-38 nats on real checkpoints."""
    model = build(name)
    check_logit_head(model)  # accepted: the transform is modelled
    ids = torch.randint(1, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1, 3] = False
    upstream = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    logp, _ = completion_logprobs(model, ids, attention, mask, temperature=0.7, chunk_size=5, share_prompts=False)
    (logp * upstream).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(input_ids=ids).logits[:, -5:-1] / 0.7  # [3, 4, V]: the model's own, transform included
    want = logits.log_softmax(-1).gather(-1, ids[:, -4:].unsqueeze(-1)).squeeze(-1) * mask
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want.detach(), atol=1e-5, rtol=1e-5)
    assert float((logp - want).abs().max()) < 1e-5
    assert LogitTransform.of(model) != LogitTransform()  # ignoring it: 8.6-18 nats off on these models
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4)


class DoubledLogits(LlamaForCausalLM):
    """A model whose forward does something sgrpo does not model: logits x 2."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_model_with_an_unknown_logit_transform_is_refused():
    torch.manual_seed(0)
    check_logit_head(LlamaForCausalLM(LlamaConfig(**SMALL)))
    with pytest.raises(ValueError, match="DoubledLogits's forward turns its hidden states into logits"):
        check_logit_head(DoubledLogits(LlamaConfig(**SMALL)))


def test_dropout_is_off_in_training_unless_asked_for(tmp_path):
    """Two train-mode forwards of a model with dropout 0.1 differ (ratio 0.90-1.10 on-policy); the policy
    turns every dropout off (nn.Dropout modules and the attention's rate) unless keep_dropout."""
    path = ensure_tiny_model(tmp_path / "tiny")
    config = LlamaConfig.from_pretrained(path)
    config.attention_dropout = 0.1
    config.save_pretrained(path)
    task = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2)
    ids = torch.randint(3, 17, (4, 12), generator=torch.Generator().manual_seed(0))
    for keep, differs in ((False, False), (True, True)):
        policy = GRPOPolicy(str(path), task, GRPO(), HFRollout(max_new_tokens=4), group_size=2, keep_dropout=keep)
        policy.configure_model()
        assert policy.model.training
        a, b = (policy.model(input_ids=ids).logits for _ in range(2))
        assert (not torch.equal(a, b)) == differs
    with_module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3))
    assert disable_dropout(with_module) == 1 and with_module[1].p == 0.0


def test_dropout_a_model_reads_from_its_config_in_forward_is_off_too():
    """Falcon reads ``hidden_dropout`` and ``attention_dropout`` from its config at each forward (no ``nn.Dropout``):
    two train-mode forwards differed (0.17 in the logits) with dropout off."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          hidden_dropout=0.1, attention_dropout=0.1)  # fmt: skip
    model = FalconForCausalLM(config).train()
    assert disable_dropout(model) >= 2 and model.config.hidden_dropout == model.config.attention_dropout == 0.0
    ids = torch.randint(0, 64, (2, 10))
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_top_p_is_allowed_for_training_as_verl_allows_it():
    """The paper's recipes sample with top-p 0.999: the engine draws from the nucleus, the loss keeps the full
    softmax's log-probs (verl's way), so top-p alone is no truncation training refuses."""
    task = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2)
    policy = GRPOPolicy("unused", task, GRPO(), HFRollout(max_new_tokens=4, top_p=0.999))
    assert policy.rollout.truncation() is None and policy.rollout.top_p == 0.999
    assert HFRollout(max_new_tokens=4, top_p=0.9, top_k=5).truncation() == "top_k=5"


@pytest.mark.parametrize("setting", [{"top_k": 5}, {"min_new_tokens": 2}])
def test_truncated_sampling_is_refused_for_training_and_allowed_for_validation(setting):
    """The loss models softmax(logits / T); a truncated sampler would put every importance ratio off."""
    task = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2)
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"rollout samples with {name}=.*val_rollout"):
        GRPOPolicy("unused", task, GRPO(), HFRollout(max_new_tokens=4, **setting))
    policy = GRPOPolicy("unused", task, GRPO(), HFRollout(max_new_tokens=4), val_rollout=HFRollout(4, **setting))
    assert policy.val_rollout.truncation() is not None and policy.rollout.truncation() is None
