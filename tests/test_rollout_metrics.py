"""HF rollout packaging and the evaluation maths (pass@k, accuracy by difficulty)."""

from __future__ import annotations

import math

import pytest
import torch

from sgrpo.eval.passk import accuracy_by_difficulty, pass_at_k, pass_at_k_by_difficulty, success_count_histogram
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import HFRollout, completion_mask_until_eos, render_prompt
from sgrpo.types import Example


def test_completion_mask_stops_after_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])  # eos = 2
    mask, truncated = completion_mask_until_eos(ids, [2])
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]


def test_render_prompt_plain_text_and_chat_without_template():
    tok = build_char_tokenizer()
    assert render_prompt(tok, "s:31=") == "s:31="
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert render_prompt(tok, chat) == "System: Be brief.\n\nUser: 1+1?\n\nAssistant:"


def test_hf_rollout_rows_masks_and_texts():
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok)
    examples = [Example("1+2=", "3"), Example("s:312=", "123")]
    torch.manual_seed(0)
    batch = HFRollout(max_new_tokens=5, max_batch_rows=4).generate(model, tok, examples, group_size=3)
    assert batch.input_ids.shape[0] == 6 and batch.group_size == 3 and batch.num_groups == 2
    p = batch.prompt_length
    assert p == 6  # the longer prompt; the shorter one is left-padded
    assert batch.input_ids[0, 0].item() == tok.pad_token_id and batch.attention_mask[0, 0].item() == 0
    assert all(tok.decode(batch.input_ids[r, :p], skip_special_tokens=True) == "1+2=" for r in range(3))
    assert batch.completion_mask.shape[1] <= 5
    for row, text in enumerate(batch.completions):  # texts are the masked tokens, decoded
        ids = batch.input_ids[row, p:][batch.completion_mask[row]]
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert torch.equal(batch.attention_mask[:, p:].bool(), batch.completion_mask)
    greedy = HFRollout(max_new_tokens=5).generate(model, tok, examples, group_size=2, greedy=True)
    assert greedy.completions[0] == greedy.completions[1]  # argmax decoding repeats itself


def test_hf_rollout_validates_settings():
    with pytest.raises(ValueError, match="temperature"):
        HFRollout(temperature=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        HFRollout(max_new_tokens=0)


def test_pass_at_k_unbiased_estimator():
    # n = 4, c = 2: pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@4 = 1
    c = torch.tensor([2, 0, 4])
    assert pass_at_k(c, 4, 1).tolist() == pytest.approx([0.5, 0.0, 1.0])
    assert pass_at_k(c, 4, 2).tolist() == pytest.approx([5 / 6, 0.0, 1.0])
    assert pass_at_k(c, 4, 4).tolist() == pytest.approx([1.0, 0.0, 1.0])
    # n = 16, c = 3, k = 5: 1 - C(13,5)/C(16,5)
    assert pass_at_k(torch.tensor([3]), 16, 5).item() == pytest.approx(1 - math.comb(13, 5) / math.comb(16, 5))
    with pytest.raises(ValueError):
        pass_at_k(c, 4, 5)


def test_accuracy_by_difficulty_groups_and_sorts_levels():
    correct = torch.tensor([[1, 1], [0, 1], [0, 0], [1, 0]], dtype=torch.bool)
    acc = accuracy_by_difficulty(correct, [5, 3, 5, 10])
    assert list(acc) == ["3", "5", "10"]
    assert acc == {"3": 0.5, "5": 0.5, "10": 0.5}


def test_pass_at_k_by_difficulty_and_success_histogram_by_hand():
    # level 3: prompts with 2/4 and 0/4 correct; level 7: one prompt with 1/4 correct
    correct = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    by_level = pass_at_k_by_difficulty(correct, [3, 3, 7])
    assert list(by_level) == ["3", "7"] and list(by_level["3"]) == [1, 2, 3, 4]
    assert by_level["3"][1] == pytest.approx(0.25) and by_level["3"][2] == pytest.approx((5 / 6 + 0) / 2)
    assert by_level["7"][2] == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2)) and by_level["7"][4] == 1.0
    assert success_count_histogram(correct) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])
