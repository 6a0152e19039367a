"""LoRA through peft: only adapters train, checkpoints hold them, rollouts sample base + adapter, exports load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgrpo.fit import main
from sgrpo.model.lora import LoRA, apply_lora, is_adapter, plain_weights
from sgrpo.rollout import HFRollout
from tasks.synthetic import SyntheticTask

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "sgrpo" / "assets" / "quickstart_model"
IDS = torch.tensor([[16, 15, 6, 4, 7, 14, 5, 6, 7, 2]])  # "s:314=" and a completion


def fit(root: Path, *extra: str):
    return main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        "--trainer.val_check_interval=100", "--trainer.enable_progress_bar=false",
        "--model.peft.rank=4", "--model.peft.alpha=8", "--model.optimizer.init_args.lr=0.01", *extra,
    ])  # fmt: skip


def test_only_the_adapters_train_and_the_checkpoint_holds_them(tmp_path):
    cli = fit(tmp_path, "--trainer.max_steps=3")
    model = cli.model.model
    base = AutoModelForCausalLM.from_pretrained(SHIPPED).state_dict()
    trained = {name: p for name, p in model.named_parameters()}
    adapters = [name for name in trained if is_adapter(name)]
    assert adapters and all(trained[n].requires_grad == is_adapter(n) for n in trained)
    assert any(n.endswith("lora_B.default.weight") and trained[n].abs().sum() > 0 for n in adapters)  # B was 0
    for name, param in trained.items():  # the base is untouched
        if not is_adapter(name):
            torch.testing.assert_close(param, base[name.replace(".base_layer.", ".")], rtol=0, atol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
    optimizer = cli.model.optimizers().optimizer
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        trained[n].numel() for n in adapters
    )  # optimiser state for the adapters only: 11,776 of 144,256 parameters
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["state_dict"] and all(is_adapter(k) for k in checkpoint["state_dict"])


def test_exports_and_resume_reproduce_the_trained_policy(tmp_path):
    from peft import PeftModel

    cli = fit(tmp_path / "full", "--trainer.max_steps=3", "--model.peft.export_merged=true")
    with torch.no_grad():
        want = cli.model.model(IDS).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SHIPPED), tmp_path / "full/hf_model")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "hf_model" / "merged")  # transformers alone
        torch.testing.assert_close(adapted(IDS).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(IDS).logits, want, atol=1e-5, rtol=1e-5)
    fit(tmp_path / "cut", "--trainer.max_steps=2")
    resumed = fit(tmp_path / "cut", "--trainer.max_steps=3", "--ckpt_path=last")  # adapters + optimiser restored
    with torch.no_grad():
        torch.testing.assert_close(resumed.model.model(IDS).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("snapshot", [False, True])
def test_rollouts_sample_base_plus_adapter(snapshot):
    """Adapter-aware decoding (the native step runs the LoRA layers) and decoding on a snapshot with the
    adapters merged in give the same tokens and log-probs as the model's own forward implies."""
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    apply_lora(model, LoRA(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.default.weight"):
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    examples = SyntheticTask(kind="sort", levels=[3, 5], num_train=16, num_validation=2).examples("train")[:4]
    torch.manual_seed(0)
    batch = HFRollout(max_new_tokens=8, weights_snapshot=snapshot).generate(model, tokenizer, examples, 3)
    from sgrpo.model.logprobs import completion_logprobs

    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    torch.testing.assert_close(batch.logprobs, logp, atol=2e-5, rtol=1e-5)
    merged = dict(plain_weights(model))
    assert not any(is_adapter(n) or ".base_layer." in n for n in merged)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           model.model.layers[0].self_attn.q_proj.base_layer.weight)  # fmt: skip


def test_merged_state_is_kept_by_the_leader_alone(monkeypatch, tmp_path):
    """Every process walks every merged weight (under FSDP2 each is a collective); only the leader keeps copies.
    ``save_policy`` of a LoRA policy with the merged export: the others keep nothing."""
    import sgrpo.export
    import sgrpo.model.lora
    from sgrpo.model.lora import merged_state

    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    apply_lora(model, LoRA(rank=4, alpha=8))
    walked, real = [], sgrpo.model.lora.plain_weights

    def counting(*args, **kwargs):
        for name, value in real(*args, **kwargs):
            walked.append(name)
            yield name, value

    monkeypatch.setattr(sgrpo.model.lora, "plain_weights", counting)
    full = merged_state(model)
    every = list(walked)
    walked.clear()
    assert merged_state(model, keep=False) == {} and walked == every  # all gathered, none kept
    assert full.keys() and not any(is_adapter(n) for n in full)
    kept = []
    monkeypatch.setattr(sgrpo.export, "merged_state", lambda m, keep=True: kept.append(keep) or {})
    monkeypatch.setattr(sgrpo.export, "save_adapter", lambda *a: None)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    for leader in (False, True):
        sgrpo.export.save_policy(model, tokenizer, tmp_path / str(leader), LoRA(rank=4), SHIPPED, True, leader=leader)
    assert kept == [False, True]
