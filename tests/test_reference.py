"""The KL reference: the loaded policy in the dtypes its forward computes in (half the bytes under bf16), or with
LoRA the policy itself with its adapters off (sgrpo/train/reference.py). Its FSDP2 sharding is checked on 2
processes in tests/test_sharded.py."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from estimators import GRPO
from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.lora import LoRA, adapters_off, is_adapter
from sgrpo.train.loss import ClippedSurrogate
from sgrpo.train.reference import build_reference
from tests.engine_helpers import run_steps
from tests.test_policy_gradients import batch as batch  # the module-scoped fixtures: the tiny model and its rollout
from tests.test_policy_gradients import make_policy
from tests.test_policy_gradients import model_dir as model_dir

KL = ClippedSurrogate(kl_coef=0.1)


def logprobs(model: nn.Module, batch, precision_dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", precision_dtype or torch.float32, enabled=precision_dtype is not None):
        mask = batch.completion_mask
        return completion_logprobs(model, batch.input_ids, batch.attention_mask, mask)[0] * mask


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def constructed(monkeypatch) -> list[int]:
    """Counts the Llama models built from here on (loaded, or built from a config)."""
    built: list[int] = []
    init = LlamaForCausalLM.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", counting)
    return built


def test_bf16_mixed_reference_is_bf16_and_gives_the_fp32_references_log_probs(model_dir, batch, monkeypatch):
    """Under bf16-mixed the reference's Linear weights (all but the LM head, which sgrpo.model.head computes in float32)
    are bf16: autocast would cast an fp32 reference's to the same values at every use, so its log-probs are the
    fp32 reference's exactly, at fewer bytes; it is built from the loaded policy, not loaded again."""
    built = constructed(monkeypatch)
    policy = make_policy(model_dir, batch, GRPO(), loss=KL)
    trainer = run_steps(policy, precision="bf16-mixed")
    models = len(built)
    reference = policy._reference
    head = reference.get_output_embeddings()
    linears = [m for m in reference.modules() if isinstance(m, nn.Linear) and m is not head]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert head.weight.dtype == torch.float32 and not any(p.requires_grad for p in reference.parameters())
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir)
    assert nbytes(reference) < 0.55 * nbytes(fp32)  # measured 0.505
    assert models == 2  # the policy loaded and its reference built from it (before: loaded twice, fp32)
    want = logprobs(fp32, batch, torch.bfloat16)  # what the fp32 reference gave under bf16-mixed
    assert torch.equal(logprobs(reference, batch, torch.bfloat16), want)
    # every weight in bf16 (embeddings, norms and head too) would be off: measured up to 2.7e-3 nats, 8e-4 mean
    all_bf16 = build_reference(fp32, "bf16-true")
    assert (logprobs(all_bf16, batch, torch.bfloat16) - want).abs().max() > 1e-4
    assert float(trainer.callback_metrics["train/kl"]) == 0.0  # one epoch: the policy is still the reference


def test_bf16_true_reference_is_the_initial_policy_number_for_number(model_dir, batch):
    """Under bf16-true the policy's weights are bf16, and so are the reference's: the KL at the first optimiser
    step, taken at the weights that sampled, is exactly 0 (an fp32 reference gave a KL of bf16 rounding)."""
    policy = make_policy(model_dir, batch, GRPO(), loss=KL)
    trainer = run_steps(policy, precision="bf16-true")
    assert {p.dtype for p in policy._reference.parameters()} == {torch.bfloat16}
    assert float(trainer.callback_metrics["train/kl"]) == 0.0


def test_bf16_true_keeps_rope_s_frequencies_in_float32_so_the_export_is_the_trained_policy(model_dir, batch,
                                                                                            tmp_path):  # fmt: skip
    """Lightning's bf16-true converts the module whole, buffers too: RoPE's inverse frequencies were rounded to bf16
    in the trained policy (and its reference), while the export loaded with transformers, and vLLM, rotate with
    float32 ones, so the export's logits were not the trained policy's (0.008 apart on this tiny model; found by a
    review). The frequencies stay float32 now, in the policy and its reference, and the export gives its logits."""
    policy = make_policy(model_dir, batch, GRPO(), loss=KL)
    run_steps(policy, precision="bf16-true", root=tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.bfloat16)
    for model in (policy.model, policy._reference, loaded):
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    policy.model.eval()
    torch.testing.assert_close(logprobs(policy.model, batch), logprobs(loaded, batch), atol=0, rtol=0)


def test_lora_reference_is_the_base_with_the_adapters_off(model_dir, batch, monkeypatch):
    """With LoRA no second model is built: the KL is taken against the policy with its adapters off, whose
    log-probs are those of the base loaded on its own; the adapters (trained away from 0) are back on after."""
    built = constructed(monkeypatch)
    sgd = lambda p: torch.optim.SGD(p, lr=0.5)  # noqa: E731
    policy = make_policy(model_dir, batch, GRPO(), loss=KL, peft=LoRA(rank=4), optimizer=sgd)
    run_steps(policy, steps=2)
    assert len(built) == 1 and policy._reference is None  # before: a second model, loaded from disk
    model = policy.model
    adapted = logprobs(model, batch)
    base = logprobs(AutoModelForCausalLM.from_pretrained(model_dir), batch)
    with adapters_off(model) as reference:
        assert reference is model
        torch.testing.assert_close(logprobs(reference, batch), base, atol=1e-6, rtol=0)
    assert (adapted - base).abs().max() > 1e-3  # the adapters moved the policy: they were off above
    assert torch.equal(logprobs(model, batch), adapted)
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())


def test_a_lora_reference_with_dropout_kept_is_deterministic(model_dir, batch):
    """LoRA with ``keep_dropout`` (a LoRA dropout > 0 keeps the model's dropout): the reference, the policy with its
    adapters off, ran in train mode, so the base model's own dropout made its log-probs differ call to call (found
    by a review); a built reference is an eval-mode copy. It runs in eval mode now, every module's mode put back."""
    from sgrpo.model.lora import apply_lora
    from sgrpo.train.reference import reference_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, attention_dropout=0.5)
    apply_lora(model, LoRA(rank=4, dropout=0.1))
    model.train()
    with reference_model(model, None) as reference:
        first, second = logprobs(reference, batch), logprobs(reference, batch)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert all(module.training for module in model.modules())


def test_validate_and_test_build_no_reference_and_a_fit_after_them_does(model_dir, batch):
    """``sgrpo.fit validate|test`` never use the KL reference: it is not built (a second model's memory); a fit
    after a validation (``validate_before``) builds it then, from the policy's still initial weights."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from sgrpo.rollout.engine import weights_version

    policy = make_policy(model_dir, batch, GRPO(), loss=KL)
    state = SimpleNamespace(fn=TrainerFn.VALIDATING)
    policy._trainer = SimpleNamespace(state=state, precision_plugin=SimpleNamespace(precision="32-true"))
    policy.configure_model()
    assert policy.model is not None and policy._reference is None
    assert weights_version(policy.model) == 1  # known weights: a vLLM engine syncs once per validation, not per batch
    state.fn = TrainerFn.TESTING
    policy.configure_model()
    assert policy._reference is None
    state.fn = TrainerFn.FITTING
    policy.configure_model()
    reference = policy._reference
    assert reference is not None and reference is not policy.model
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), policy.model.parameters()))


def test_the_reference_and_the_rollout_snapshot_keep_the_model_s_buffer_dtypes(tmp_path):
    """A bf16 model (``model.dtype: bfloat16``) under bf16-mixed keeps RoPE's inverse frequencies in float32; the
    copies were cast whole, buffers too, so the reference's rotations drifted (KL 2.1 at positions past 1,024,
    where it starts at 0) and so did the FSDP2 rollout snapshot's. Now the copies' logits are the model's."""
    from transformers import LlamaConfig

    from sgrpo.rollout.snapshot import copy_weights, plain_shell

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, vocab_size=64, max_position_embeddings=4096, rope_theta=1e6,
                         initializer_range=0.2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert policy.model.rotary_emb.inv_freq.dtype == torch.float32
    snapshot = plain_shell(policy).to_empty(device="cpu")
    copy_weights(policy, snapshot)
    ids = torch.randint(0, 64, (1, 1500), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = policy(ids).logits
        for copy in (build_reference(policy, "bf16-mixed"), snapshot):
            assert copy.model.rotary_emb.inv_freq.dtype == torch.float32
            assert torch.equal(copy(ids).logits, logits)
