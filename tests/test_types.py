"""RolloutBatch: selecting groups and joining batches of different prompt and completion lengths."""

from __future__ import annotations

import torch

from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.rollout import HFRollout
from sgrpo.types import RolloutBatch
from tests.engine_helpers import EXAMPLES


def test_joined_batches_keep_every_rows_tokens_and_logprobs(tmp_path):
    """Two rollouts (prompts of 2-4 and 3-4 digits, completions of different lengths) joined, then groups
    picked: each row keeps its tokens, masks and sampler log-probs, and the model gives it the same log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_model(tmp_path / "tiny")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    first = HFRollout(max_new_tokens=5, top_p=0.9).generate(model, tokenizer, EXAMPLES[:3], 2)  # 31, 402, 9175
    second = HFRollout(max_new_tokens=3, top_p=0.9).generate(model, tokenizer, EXAMPLES[4:6], 2)  # 803, 4127
    joined = RolloutBatch.cat([first, second])
    assert joined.num_groups == 5 and joined.completions == first.completions + second.completions
    picked = joined.select_groups(torch.tensor([3, 0]))  # second's first group, then first's first group
    assert picked.completions == second.completions[:2] + first.completions[:2]
    with torch.no_grad():
        def logp(batch: RolloutBatch) -> torch.Tensor:
            return completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)[0]

        got, parts = logp(picked), (logp(second)[:2], logp(first)[:2])
    for rows, part, source in ((slice(0, 2), parts[0], second), (slice(2, 4), parts[1], first)):
        t = part.shape[1]
        torch.testing.assert_close(got[rows, :t], part, atol=1e-5, rtol=1e-5)
        assert (got[rows, t:] == 0).all()  # completion padding is outside the mask
        torch.testing.assert_close(picked.completion_mask[rows, :t], source.completion_mask[:2], rtol=0, atol=0)
        torch.testing.assert_close(picked.logprobs[rows, :t], source.logprobs[:2], rtol=0, atol=0)
        # top-p's kept mass per token travels with its row: in [0.9, 1] on the completion, 0 on its padding
        torch.testing.assert_close(picked.nucleus_mass[rows, :t], source.nucleus_mass[:2], rtol=0, atol=0)
        mask = picked.completion_mask[rows]
        assert (picked.nucleus_mass[rows][mask] >= 0.9 - 1e-6).all() and (picked.nucleus_mass[rows][~mask] == 0).all()
