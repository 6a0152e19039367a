"""``python -m sgrpo.eval.alpaca``: AlpacaEval outputs from an exported model, offline on the shipped tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgrpo.eval.alpaca import generate, main

FIXTURE = Path(__file__).parent / "fixtures" / "alpaca_eval_tiny.json"
MODEL = str(Path(__file__).parent.parent / "sgrpo" / "assets" / "quickstart_model")


class FakeModel:
    """Greedy, 3 new tokens a prompt, which the test's decoder reads as one fixed completion (the shipped tokenizer
    spells digits and ``+ = :`` only)."""

    device = "cpu"

    def generate(self, input_ids, attention_mask, do_sample, max_new_tokens, pad_token_id):
        import torch

        assert do_sample is False and max_new_tokens == 64
        self.prompts = input_ids
        return torch.cat([input_ids, torch.ones(len(input_ids), 3, dtype=input_ids.dtype)], dim=1)


def test_the_outputs_are_the_final_texts_in_alpaca_eval_s_schema():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = json.loads(FIXTURE.read_text())
    model = FakeModel()
    decode = tokenizer.batch_decode
    tokenizer.batch_decode = lambda ids, **kw: [  # noqa: E731
        "<think>some reasoning</think> Final answer here.<|im_end|>" if len(row) == 3 else decode([row], **kw)[0]
        for row in ids]  # fmt: skip
    out = generate(model, tokenizer, rows, 64, 4096, "sgrpo_ot", batch_size=2)
    assert [r["instruction"] for r in out] == [r["instruction"] for r in rows]
    assert [r["dataset"] for r in out] == ["helpful_base", "helpful_base", "koala"]
    assert {r["generator"] for r in out} == {"sgrpo_ot"} and set(out[0]) == {"instruction", "output", "generator",
                                                                             "dataset"}  # fmt: skip
    assert {r["output"] for r in out} == {"Final answer here."}  # the final text: after </think>
    assert len(model.prompts) == 1  # batches of 2: the third instruction alone


def test_the_command_writes_the_file_with_the_tiny_model(tmp_path):
    output = tmp_path / "o" / "out.json"
    records = main(["--model", MODEL, "--instructions", str(FIXTURE), "--output", str(output), "--max-new-tokens", "4",
                    "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"])  # fmt: skip
    assert json.loads(output.read_text()) == records and len(records) == 3
    assert all(isinstance(r["output"], str) and r["generator"] == "sgrpo" for r in records)


def test_a_prompt_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--model", MODEL, "--instructions", str(FIXTURE), "--output", str(tmp_path / "out.json"),
              "--max-new-tokens", "4", "--max-model-len", "10", "--device", "cpu"])  # fmt: skip
    assert stop.value.code == 2 and "raise --max-model-len" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
