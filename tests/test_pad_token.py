"""Tokenizers without a pad token (Llama-3.x, Mistral): EOS pads, and every mask stays what it was.

The tiny model's tokenizer, stripped of its pad token, must sample, train and validate exactly as the
tokenizer with one: prompt padding then holds EOS instead of ``<pad>``, and nothing reads ids to find it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgrpo.fit import main
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.rollout import HFRollout, left_padded, with_pad_token
from sgrpo.types import Example

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [Example(prompt=p, answer="") for p in ("s:31=", "s:9175=", "s:4=")]  # lengths 5, 7, 4: padding


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """The tiny model, and a copy whose tokenizer has no pad token."""
    padded = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    bare = tmp_path_factory.mktemp("tiny_no_pad")
    for path in padded.iterdir():
        shutil.copy(path, bare / path.name)
    tokenizer = AutoTokenizer.from_pretrained(padded)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(bare)
    assert AutoTokenizer.from_pretrained(bare).pad_token is None
    return str(padded), str(bare)


def test_left_padding_masks_come_from_lengths_not_from_the_pad_id():
    """A prompt that holds the pad id itself (EOS, when EOS pads) keeps it unmasked."""
    ids, mask = left_padded([[5, 2, 6], [2]], pad=2, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 2, 6], [2, 2, 2]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize("decoder", ["lean", "generate"])
def test_a_tokenizer_without_pad_token_samples_what_one_with_it_samples(model_dirs, decoder):
    """A tokenizer object passed as it is (not through the policy): the rollout pads with EOS and the batch
    equals the padded tokenizer's everywhere but in the ids of masked prompt positions."""
    padded, bare = model_dirs
    model = AutoModelForCausalLM.from_pretrained(padded)
    batches = []
    for path in (padded, bare):
        torch.manual_seed(0)
        rollout = HFRollout(max_new_tokens=6, decoder=decoder)
        batches.append(rollout.generate(model, AutoTokenizer.from_pretrained(path), PROMPTS, group_size=3))
    with_pad, without = batches
    eos = AutoTokenizer.from_pretrained(bare).eos_token_id
    assert torch.equal(with_pad.attention_mask, without.attention_mask)
    assert torch.equal(with_pad.completion_mask, without.completion_mask)
    assert torch.equal(with_pad.truncated, without.truncated)
    assert with_pad.completions == without.completions
    real = with_pad.attention_mask.bool()
    assert torch.equal(with_pad.input_ids[real], without.input_ids[real])
    p = with_pad.prompt_length
    assert (without.input_ids[:, :p][~real[:, :p]] == eos).all() and (~real[:, :p]).any()  # EOS pads the prompts
    if decoder == "lean":
        torch.testing.assert_close(with_pad.logprobs, without.logprobs, rtol=0, atol=0)


def test_policy_sets_eos_as_pad_token():
    from transformers import PreTrainedTokenizerFast

    from sgrpo.model.tiny import build_char_tokenizer

    tokenizer: PreTrainedTokenizerFast = build_char_tokenizer()
    tokenizer.pad_token = None
    assert with_pad_token(tokenizer).pad_token == "<eos>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    kept = build_char_tokenizer()
    assert with_pad_token(kept).pad_token == "<pad>"  # a pad token of its own stays


def _fit_rows(root: Path, model_dir: str) -> list[dict]:
    main([
        "--config", str(REPO / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={root}",
        f"--model.model={model_dir}", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--checkpoint_every=1000",
    ])  # fmt: skip
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def test_a_fit_with_a_tokenizer_without_pad_token_equals_the_fit_with_one(model_dirs, tmp_path):
    """3 training steps and a validation: every logged value but the timings is the same, bit for bit."""
    padded, bare = model_dirs
    with_pad, without = _fit_rows(tmp_path / "pad", padded), _fit_rows(tmp_path / "no_pad", bare)

    def values(rows):
        timing = ("_s", "tok_s", "time")
        return [{k: v for k, v in row.items() if not any(t in k for t in timing)} for row in rows]

    assert len(with_pad) >= 4 and any("val/accuracy" in row for row in with_pad)
    assert values(with_pad) == values(without)
