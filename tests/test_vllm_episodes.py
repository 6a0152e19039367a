"""Multi-turn episodes through VLLMRollout on CPU, with the stand-in engine that samples from its own synced weights
(tests/vllm_fakes.py): tokens in (each turn's prompt is the row's own ids), tokens out (the engine's ids and
log-probs kept), one weight sync and one wake-up for all of a rollout's turns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from estimators import GRPO
from sgrpo.model.logprobs import completion_logprobs
from sgrpo.rollout.vllm_engine import VLLMRollout
from tests.engine_helpers import EXAMPLES, GradCapture
from tests.multiturn_helpers import DIGITS_TEMPLATE, Digits
from tests.test_episodes_training import ChatTask
from tests.test_vllm_rollout import fake_vllm, model_dir  # noqa: F401 (fixtures)
from tests.vllm_fakes import SamplingLLM


class RecordingLLM(SamplingLLM):
    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.requests = [*getattr(self, "requests", []), *zip(prompts, sampling_params)]
        return super().generate(prompts, sampling_params, use_tqdm)


def test_vllm_episodes_keep_the_engines_tokens_and_logprobs(fake_vllm, model_dir):  # noqa: F811
    fake_vllm.LLM = RecordingLLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = DIGITS_TEMPLATE
    engine = VLLMRollout(max_new_tokens=10, dtype="float32")
    torch.manual_seed(0)
    batch = engine.generate_episodes(model, tokenizer, EXAMPLES[:3], 2, Digits(max_turns=3))
    llm = engine._llm
    turns = [e.turns for e in batch.episodes]
    assert max(turns) > 1 and batch.trajectory is None  # several turns, and this template extends its tokens
    assert llm.events == ["load", "reset", *["generate"] * max(turns), "sleep1"]  # one sync, a request per turn
    assert all(p.n == 1 and p.max_tokens == 10 and p.logprobs == 0 for _, p in llm.requests)
    contexts = [r["prompt_token_ids"] for r, _ in llm.requests]
    for row in range(batch.input_ids.shape[0]):  # every request's prompt is a prefix of its row (tokens in)
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert sum(ids[: len(c)] == c for c in contexts) >= batch.episodes[row].turns
    for row, episode in enumerate(batch.episodes):  # the row is the rendered conversation
        rendered = tokenizer.apply_chat_template(episode.messages, tokenize=False)
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        if batch.truncated[row]:  # the last turn was cut before its <eos>, which the template writes
            rendered = rendered.removesuffix("<eos>")
        assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    mask = batch.completion_mask
    assert float((logp - batch.logprobs)[mask].abs().max()) <= 1e-5 and int(mask.sum()) > len(turns)


def test_pooled_vllm_engines_are_refused_for_episodes(model_dir):  # noqa: F811
    with pytest.raises(ValueError, match="model.rollout: VLLMRollout with tensor_parallel_size 2 does not run multi-"
                       "turn episodes.*VLLMRollout with tensor_parallel_size 1"):
        GradCapture(model_dir, ChatTask(), GRPO(), rollout=VLLMRollout(tensor_parallel_size=2), environment=Digits())
    assert VLLMRollout().runs_episodes


@pytest.mark.vllm
def test_real_vllm_episodes_logprobs_are_the_trainers(tmp_path):
    """The real engine (make test-vllm): float32 episodes whose turns' log-probs are the trainer's."""
    pytest.importorskip("vllm")
    from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = DIGITS_TEMPLATE
    build_tiny_llama(tokenizer, num_heads=2, max_positions=128).save_pretrained(tmp_path)  # head_dim 32 for vLLM
    tokenizer.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    engine = VLLMRollout(max_new_tokens=8, dtype="float32", enforce_eager=True, max_model_len=128,
                         engine_kwargs={"kv_cache_memory_bytes": 64 * 2**20})  # fmt: skip
    try:
        torch.manual_seed(0)
        batch = engine.generate_episodes(model, tokenizer, EXAMPLES[:4], 2, Digits(max_turns=3))
    finally:
        engine.close()
    assert max(e.turns for e in batch.episodes) > 1
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    mask = batch.completion_mask
    assert float((logp - batch.logprobs)[mask].abs().max()) <= 1e-4
