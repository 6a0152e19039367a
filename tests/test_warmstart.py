"""The quickstart warm-start: a few SFT steps save a model that loads through plain transformers, bitwise
reproducibly from the seed; and the shipped asset is the model its ``warmstart.json`` describes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgrpo.model.tiny import build_char_tokenizer
from sgrpo.types import Example
from sgrpo.warmstart import DEFAULT_OUT, Recipe, evaluate, main, make_task, sft_batch, warm_start

FAST = Recipe(seed=3, steps=6, batch_size=16)


def _generate(path: Path, prompts: list[str]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=8)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_sft_batch_masks_all_but_answer_and_eos() -> None:
    tok = build_char_tokenizer()
    batch = sft_batch(tok, [Example("s:31=", "13"), Example("s:312=", "123")])
    # row 0 (8 tokens) is left-padded to row 1's 10: [pad, pad, s, :, 3, 1, =, 1, 3, eos]; labels on "13" + eos
    assert batch["input_ids"][0, :2].tolist() == [tok.pad_token_id] * 2 and batch["attention_mask"][0, 2:].all()
    assert batch["labels"][0].tolist()[-3:] == [*tok.encode("13", add_special_tokens=False), tok.eos_token_id]
    assert (batch["labels"][0, :-3] == -100).all() and (batch["labels"][1, :-4] == -100).all()
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]


def test_warm_start_saves_a_loadable_reproducible_model(tmp_path: Path, monkeypatch) -> None:
    # warm_start takes 2 intra-op threads (the machine's 2 cores); beside make test's other worker that is 3 busy
    # threads on 2 cores, whose spin-waits made this test the suite's longest: both runs keep the test's one
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    report = warm_start(tmp_path / "a", FAST, eval_prompts=4)
    main(["--out", str(tmp_path / "b"), "--seed", "3", "--steps", "6", "--batch-size", "16", "--eval-prompts", "0"])

    assert report["losses"][-1] < report["losses"][0]
    saved = json.loads((tmp_path / "a" / "warmstart.json").read_text())
    assert saved["recipe"]["steps"] == 6 and set(saved["accuracy"]) == {"greedy", "sampled"}
    assert set(saved["accuracy"]["greedy"]) == {"3", "5", "7"}

    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer.decode(tokenizer("s:3142=")["input_ids"]) == "s:3142="
    texts = _generate(tmp_path / "a", ["s:3142=", "s:50381="])
    assert len(texts) == 2 and all(set(t) <= set("0123456789+=:s") for t in texts)


@pytest.mark.skipif(not (DEFAULT_OUT / "model.safetensors").exists(), reason="quickstart asset not generated")
def test_shipped_asset_matches_its_report() -> None:
    info = json.loads((DEFAULT_OUT / "warmstart.json").read_text())
    recipe = Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in info["recipe"].items()})
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_OUT)
    acc = evaluate(model, AutoTokenizer.from_pretrained(DEFAULT_OUT), make_task(recipe), recipe.seed)
    for mode in ("greedy", "sampled"):
        for n, value in acc[mode].items():  # same numbers on the machine that made it; float noise elsewhere
            assert abs(value - info["accuracy"][mode][str(n)]) <= 0.1, (mode, n, value)
    assert acc["greedy"][3] >= 0.4 and acc["greedy"][7] <= 0.4  # easy prompts solved, hard ones left to RL


@pytest.mark.parametrize(
    ("module", "options", "says"),
    [
        ("warmstart", ["--steps", "0"], "--steps must be >= 1, got 0"),
        ("warmstart", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("warmstart", ["--num-heads", "3"], "--hidden-size 64 must be a multiple of 2 x --num-heads 3"),
        ("warmstart", ["--hidden-size", "12"], "--hidden-size 12 must be a multiple of 2 x --num-heads 4"),
        ("warmstart", ["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        ("warmstart_tools", ["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        ("warmstart", ["--eval-prompts", "-1"], "--eval-prompts must be >= 0 (0: no evaluation), got -1"),
        ("warmstart", ["--levels", "99"], "levels must be a non-empty list of integers in [1, 20], got [99]"),
        ("warmstart_tools", ["--tool-rate", "2"], "--tool-rate must be in [0, 1], got 2.0"),
    ],
)
def test_a_bad_option_stops_in_one_line_before_anything_is_written(module, options, says, tmp_path, capsys):
    """``--steps 0`` saved an untrained model over --out (by default the shipped asset) and then raised IndexError;
    the others raised tracebacks (max() of nothing, transformers' config check, the task's ValueError)."""
    import importlib

    with pytest.raises(SystemExit) as refused:
        importlib.import_module(f"sgrpo.{module}").main(["--out", str(tmp_path / "out"), *options])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"python -m sgrpo.{module}: error: {says}"
    assert not (tmp_path / "out").exists()
