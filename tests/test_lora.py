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


def random_adapters(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.default.weight"):
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))


def test_gpt2_s_transposed_conv1d_layers_merge_into_the_adapted_model_s_weights():
    """GPT-2 keeps its linear layers as ``Conv1D`` ([in, out]): the merge added B A untransposed, which raised for
    c_attn and the MLP and, for the square attention output, gave logits off by 0.39 without a word (the export,
    the FSDP2 snapshot and vLLM's weights all merge so)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)).eval()
    base = GPT2LMHeadModel(model.config).eval()
    apply_lora(model, LoRA(rank=2, alpha=4))
    random_adapters(model)
    missing, unexpected = base.load_state_dict(dict(plain_weights(model)), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the token embedding
    base.tie_weights()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_target_modules_that_are_not_linear_layers_or_match_nothing_are_refused_before_the_weights_load():
    """An embedding's adapters (``lora_embedding_A``) crashed the merge with ``KeyError: 'default'`` at the end of a
    fit; a misspelled module loaded every process's weights before peft's traceback. Both are one line now, from
    the model built on the meta device; so is a dropout that training would set to 0."""
    from sgrpo.model.lora import lora_problem

    assert lora_problem(LoRA(rank=2), keep_dropout=False, model_path=str(SHIPPED)) is None
    wrong = lora_problem(LoRA(rank=2, target_modules=["q_projj"]), keep_dropout=False, model_path=str(SHIPPED))
    assert wrong.startswith("model.peft.target_modules=['q_projj'] adapts nothing")
    embedding = lora_problem(LoRA(rank=2, target_modules=["embed_tokens"]), False, str(SHIPPED))
    assert embedding.startswith("model.peft.target_modules=['embed_tokens'] adapts model.embed_tokens (Embedding)")
    dropout = lora_problem(LoRA(rank=2, dropout=0.05), keep_dropout=False, model_path=str(SHIPPED))
    assert dropout.startswith("model.peft.dropout=0.05 would be set to 0") and "model.keep_dropout=true" in dropout
    assert lora_problem(LoRA(rank=2, dropout=0.05), keep_dropout=True, model_path=str(SHIPPED)) is None


def test_adapters_on_the_lm_head_are_refused_before_the_weights_load():
    """The loss and the sampler compute log-probs from the head's weight (``sgrpo.model.head``): an adapter on it was
    accepted and never trained (no gradient: B stayed 0), and under DDP its unused parameters would fail the step."""
    from sgrpo.model.lora import lora_problem

    head = lora_problem(LoRA(rank=2, target_modules=["q_proj", "lm_head"]), False, str(SHIPPED))
    assert head.startswith("model.peft.target_modules=['q_proj', 'lm_head'] adapts the LM head (lm_head)"), head
    assert "leave lm_head out" in head
    assert lora_problem(LoRA(rank=2, target_modules="all-linear"), False, str(SHIPPED)) is None


def test_a_checkpoint_is_evaluated_only_with_its_lora_settings():
    """``validate``/``test`` load adapters non-strictly: another alpha rescaled them (accuracy 0.44 -> 0.0) and other
    target modules dropped most of them, silently."""
    from dataclasses import asdict

    from sgrpo.model.lora import peft_mismatch

    trained = asdict(LoRA(rank=4, alpha=8))
    assert peft_mismatch(trained, LoRA(rank=4, alpha=8, dropout=0.1, export_merged=True)) is None
    assert peft_mismatch(None, None) is None
    assert peft_mismatch(trained, LoRA(rank=4, alpha=64)) == (
        "was trained with model.peft.alpha=8 (this config: 64); give model.peft as the run's config does")
    assert "model.peft.target_modules='all-linear' (this config: ['q_proj'])" in peft_mismatch(
        trained, LoRA(rank=4, alpha=8, target_modules=["q_proj"]))
    assert peft_mismatch(trained, None) == "was trained with LoRA adapters; give model.peft as the run's config does"
    assert peft_mismatch(None, LoRA()) == "was trained without LoRA; give model.peft as the run's config does"


def test_a_checkpoint_is_evaluated_whatever_the_order_of_its_target_modules():
    """PEFT adapts a set of modules (``LoraConfig`` keeps ``target_modules`` as a set): the same names in another
    order make the same adapters, while another name, or a regex string in place of a list, does not."""
    from dataclasses import asdict

    from sgrpo.model.lora import peft_mismatch

    trained = asdict(LoRA(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert peft_mismatch(trained, LoRA(rank=4, alpha=8, target_modules=["v_proj", "q_proj"])) is None
    assert peft_mismatch(trained, LoRA(rank=4, alpha=8, target_modules=["v_proj", "q_proj", "q_proj"])) is None
    assert peft_mismatch(trained, LoRA(rank=4, alpha=8, target_modules=["v_proj", "k_proj"])) == (
        "was trained with model.peft.target_modules=['q_proj', 'v_proj'] (this config: ['v_proj', 'k_proj']); "
        "give model.peft as the run's config does")
    assert "model.peft.target_modules=['q_proj'] (this config: 'q_proj')" in peft_mismatch(
        dict(trained, target_modules=["q_proj"]), LoRA(rank=4, alpha=8, target_modules="q_proj"))
    assert "model.peft.rank=4 (this config: 8)" in peft_mismatch(
        trained, LoRA(rank=8, alpha=8, target_modules=["v_proj", "q_proj"]))


def test_a_resume_with_dropout_kept_reproduces_the_uninterrupted_run(tmp_path):
    """``keep_dropout``: the update's dropout masks come from (seed, step, process), as the rollout's samples do; they
    came from the global RNG, which no checkpoint holds, so a resumed run drew other masks."""
    dropout = ("--model.keep_dropout=true", "--model.peft.dropout=0.5")
    whole = fit(tmp_path / "whole", "--trainer.max_steps=3", *dropout)
    fit(tmp_path / "cut", "--trainer.max_steps=2", *dropout)
    resumed = fit(tmp_path / "cut", "--trainer.max_steps=3", "--ckpt_path=last", *dropout)
    want = {n: p for n, p in whole.model.model.named_parameters() if is_adapter(n)}
    got = {n: p for n, p in resumed.model.model.named_parameters() if is_adapter(n)}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
