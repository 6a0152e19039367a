"""``python -m sgrpo.export`` from checkpoints: the model a fit exported, LoRA adapters and merged models, one-line
refusals, and an export cut midway (split from tests/test_evaluate_export.py, which keeps evaluation without
training; sharded checkpoints are exported in tests/test_sharded.py)."""

from __future__ import annotations

import errno
import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgrpo.export import main as export
from tests.test_evaluate_export import SHIPPED, error_line, logits
from tests.test_evaluate_export import lora_run as lora_run  # module fixtures: the runs exported
from tests.test_evaluate_export import run as run


def test_export_of_a_checkpoint_is_the_model_the_fit_exported(run, tmp_path, capsys):
    export([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "out")])
    assert "exported" in capsys.readouterr().out
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # transformers alone
    torch.testing.assert_close(logits(got), logits(AutoModelForCausalLM.from_pretrained(run / "hf_model")),
                               atol=0, rtol=0)  # fmt: skip
    assert not torch.equal(logits(got), logits(AutoModelForCausalLM.from_pretrained(SHIPPED)))  # trained
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("s:31=")["input_ids"]
    (tmp_path / "empty").mkdir()  # an existing empty folder (a mount point cannot be swapped): written in place
    inode = (tmp_path / "empty").stat().st_ino
    export([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "empty")])
    assert (tmp_path / "empty").stat().st_ino == inode and (tmp_path / "empty" / "config.json").is_file()


def test_export_of_a_lora_checkpoint_writes_the_adapter_and_the_merged_model(lora_run, tmp_path):
    from peft import PeftModel

    checkpoint = torch.load(lora_run / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(".lora_" in key for key in checkpoint["state_dict"])  # adapters only: the base is the model folder
    export([str(lora_run / "checkpoints" / "last.ckpt"), str(tmp_path / "out"), "--merged"])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SHIPPED), tmp_path / "out")
    want = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SHIPPED), lora_run / "hf_model"))
    torch.testing.assert_close(logits(adapted), want, atol=0, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    torch.testing.assert_close(logits(merged), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, logits(AutoModelForCausalLM.from_pretrained(SHIPPED)))


def test_a_checkpoint_without_its_record_takes_the_base_from_the_run_config_or_base(run, tmp_path, capsys):
    """A checkpoint saved before sgrpo recorded its base model: the run's config.yaml names it, else --base."""
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    del checkpoint["sgrpo"]["policy"]
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint, tmp_path / "old" / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit):
        export([str(tmp_path / "old" / "checkpoints" / "last.ckpt"), str(tmp_path / "a")])
    assert "--base" in error_line(capsys)
    export([str(tmp_path / "old" / "checkpoints" / "last.ckpt"), str(tmp_path / "a"), f"--base={SHIPPED}"])
    (tmp_path / "old" / "lightning_logs" / "version_0").mkdir(parents=True)
    shutil.copy(run / "lightning_logs" / "version_0" / "config.yaml", tmp_path / "old/lightning_logs/version_0")
    export([str(tmp_path / "old" / "checkpoints" / "last.ckpt"), str(tmp_path / "b")])
    want = logits(AutoModelForCausalLM.from_pretrained(run / "hf_model"))
    for out in ("a", "b"):
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / out)), want, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["missing", "hf_folder", "truncated", "out_not_empty", "merged_without_lora",
                                  "base_missing", "out_is_file", "nan_weights", "base_of_other_shapes"])
def test_export_refuses_in_one_line(case, run, tmp_path, capsys):
    ckpt, out, extra = run / "checkpoints" / "last.ckpt", tmp_path / "out", []
    if case == "missing":
        ckpt = tmp_path / "nothing.ckpt"
    elif case == "hf_folder":
        ckpt = run / "hf_model"
    elif case == "truncated":
        ckpt = tmp_path / "cut.ckpt"
        ckpt.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "merged_without_lora":
        extra = ["--merged"]
    elif case == "out_is_file":  # was a NotADirectoryError traceback
        out.write_text("mine")
    elif case == "nan_weights":  # a diverged run's checkpoint: no export of non-finite weights
        checkpoint = torch.load(ckpt, weights_only=False)
        checkpoint["state_dict"] = {k: torch.full_like(v, float("nan")) for k, v in checkpoint["state_dict"].items()}
        ckpt = tmp_path / "nan.ckpt"
        torch.save(checkpoint, ckpt)
    elif case == "base_of_other_shapes":  # another model's weights, wider: was a size-mismatch traceback
        from sgrpo.model.tiny import ensure_tiny_model

        extra = [f"--base={ensure_tiny_model(tmp_path / 'wide', hidden_size=48)}"]
    else:
        extra = ["--base=/nonexistent/model"]
    with pytest.raises(SystemExit) as refused:
        export([str(ckpt), str(out), *extra])
    assert refused.value.code == 2
    line = error_line(capsys)
    assert {"missing": "no checkpoint at", "hf_folder": "an HF model folder already", "truncated": "does not load",
            "out_not_empty": "is not empty", "merged_without_lora": "--merged applies to LoRA",
            "base_missing": "cannot load the base model /nonexistent/model", "out_is_file": "is a file: give a folder",
            "nan_weights": "weights are not all finite (NaN or infinite)",
            "base_of_other_shapes": "does not fit the base model"}[case] in line
    assert case in ("out_not_empty", "out_is_file") or not out.exists()


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("case", ["disk_full", "ctrl_c"])
def test_an_export_cut_midway_leaves_no_model_at_out_and_names_the_command_to_rerun(
    case, existing, run, tmp_path, monkeypatch, capsys
):
    """The weights fail to write (a full disk) or a Ctrl-C arrives once config.json is written: OUT is not made (the
    write went to a hidden folder beside it, removed), or an existing empty OUT (a mount point, say: it cannot be
    swapped) is written in place and emptied again; the one line names the command to run again."""
    from transformers import PreTrainedModel

    def cut(self, path, **kwargs):
        self.config.save_pretrained(path)  # config.json written, the weights not
        if case == "ctrl_c":
            signal.raise_signal(signal.SIGINT)
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "model.safetensors"))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", cut)
    ckpt, out = run / "checkpoints" / "last.ckpt", tmp_path / "out"
    if existing:
        out.mkdir()
    with pytest.raises((SystemExit, KeyboardInterrupt)) as cut_short:  # a KeyboardInterrupt: no handler of its own
        export([str(ckpt), str(out)])
    assert isinstance(cut_short.value, SystemExit) and cut_short.value.code == {"disk_full": 1, "ctrl_c": 130}[case]
    assert list(tmp_path.iterdir()) == ([out] if existing else [])  # nor the hidden folder it wrote into
    assert not existing or list(out.iterdir()) == []
    line = error_line(capsys) if case == "disk_full" else capsys.readouterr().err.strip()
    assert f"python -m sgrpo.export {ckpt} {out}" in line and "ckpt_path" not in line, line
    assert {"disk_full": "No space left on device", "ctrl_c": "Ctrl-C during the export"}[case] in line


def test_a_second_ctrl_c_does_not_cut_the_emptying_of_an_existing_out_short(tmp_path, monkeypatch):
    """A Ctrl-C between files of an export into an existing empty OUT empties it again; a second one during that
    emptying (or a scheduler's repeated SIGTERM) was raised from inside it, leaving part of the export in OUT (and
    the rerun the message names refused as "not empty")."""
    import os

    import sgrpo.export as module

    out, removed, remove = tmp_path / "out", [], module.remove_path
    out.mkdir()

    def remove_path(path):
        removed.append(path)
        if len(removed) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the first is cleaned up
        remove(path)

    monkeypatch.setattr(module, "remove_path", remove_path)
    with pytest.raises(module.ExportInterrupted), module.staged_export(out, again="", in_place=True) as staged:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (staged / name).write_text("x")
        os.kill(os.getpid(), signal.SIGINT)  # the first
    assert list(out.iterdir()) == [] and len(removed) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back


def test_a_lora_checkpoint_that_named_the_lm_head_exports_without_its_untrained_head_adapters():
    """LoRA on the LM head is refused now (its adapters never trained: the loss reads the head's weight); a checkpoint
    from before, whose record names the head, exported with a traceback. Its head adapters (B = 0) are left out; a
    non-zero B there is refused in one line."""
    from sgrpo.export import CheckpointError, load_policy
    from sgrpo.model.lora import LoRA, apply_lora

    trained = apply_lora(AutoModelForCausalLM.from_pretrained(SHIPPED), LoRA(rank=2, target_modules=["q_proj"]))
    weights = {k: v for k, v in trained.state_dict().items() if ".lora_" in k}
    hidden, vocab = trained.config.hidden_size, trained.config.vocab_size
    head = {"lm_head.lora_A.default.weight": torch.randn(2, hidden),
            "lm_head.lora_B.default.weight": torch.zeros(vocab, 2)}
    record = {"base": str(SHIPPED), "dtype": "float32", "peft": {"rank": 2, "alpha": 32.0, "dropout": 0.0,
                                                                  "target_modules": ["q_proj", "lm_head"]}}  # fmt: skip
    model, _, peft = load_policy(weights | head, record)
    assert peft.target_modules == ["q_proj"] and not any("lm_head.lora" in k for k in model.state_dict())
    head["lm_head.lora_B.default.weight"] = torch.ones(vocab, 2)
    with pytest.raises(CheckpointError, match="adapter on the LM head .* is not zero"):
        load_policy(weights | head, record)
