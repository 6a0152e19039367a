"""The tool model's warm start: a few SFT steps save a chat model that loads through plain transformers with its
template, bitwise reproducibly from the seed; the shipped asset is the model its ``warmstart.json`` describes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgrpo.model.tiny import CHAT_TEMPLATE
from sgrpo.warmstart import recipe_from
from sgrpo.warmstart_tools import DEFAULT_OUT, Recipe, evaluate, main, make_task, warm_start

FAST = Recipe(seed=3, steps=4, batch_size=8, levels=(1, 2))


def test_warm_start_saves_a_loadable_reproducible_chat_model(tmp_path: Path) -> None:
    report = warm_start(tmp_path / "a", FAST, eval_prompts=1)
    main(["--out", str(tmp_path / "b"), "--seed", "3", "--steps", "4", "--batch-size", "8", "--levels", "1", "2",
          "--eval-prompts", "0"])  # fmt: skip
    saved = json.loads((tmp_path / "a" / "warmstart.json").read_text())
    assert report["losses"][-1] < report["losses"][0] and saved["recipe"]["operations"] == ["add", "mul"]
    assert set(saved["episodes"]) == {"sampled", "greedy"}
    assert set(saved["episodes"]["sampled"]["tool_use"]) == {"1", "2"}
    assert [t["function"]["name"] for t in saved["tools"]] == ["add", "mul"]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "a").config.max_position_embeddings == FAST.max_positions


@pytest.mark.slow
@pytest.mark.skipif(not (DEFAULT_OUT / "model.safetensors").exists(), reason="tool model asset not generated")
def test_shipped_asset_matches_its_report() -> None:
    info = json.loads((DEFAULT_OUT / "warmstart.json").read_text())
    recipe = recipe_from(Recipe, info["recipe"])
    assert recipe == Recipe()  # `python -m sgrpo.warmstart_tools` with its defaults rebuilds it
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_OUT)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_OUT)
    prompts = int(info["eval"].split()[0])
    measured = evaluate(model, tokenizer, make_task(recipe, prompts), recipe, recipe.seed)
    for mode, by_metric in measured.items():  # the same numbers on the machine that made it; float noise elsewhere
        for metric, by_level in by_metric.items():
            for n, value in by_level.items():
                assert abs(value - info["episodes"][mode][metric][str(n)]) <= 0.15, (mode, metric, n, value)
    sampled = info["episodes"]["sampled"]
    assert all(0.25 <= rate <= 0.75 for rate in sampled["tool_use"].values())  # headroom for RL to call more
    assert sampled["success"]["3"] < 0.8  # ... and to answer more often right
