"""The policy model: loading, sharding and gathering its shards, the LM head shared by sampling and the loss,
completion log-probs, LoRA through peft, and the tiny models the tests and the quickstart build."""

from sgrpo.model.head import LMHead, TokenLogprobs
from sgrpo.model.loading import resolve_model_path, shard_model
from sgrpo.model.logprobs import completion_logprobs, logprob_mismatch
from sgrpo.model.lora import LoRA, apply_lora
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama

__all__ = [
    "LMHead", "LoRA", "TokenLogprobs", "apply_lora", "build_char_tokenizer", "build_tiny_llama", "completion_logprobs",
    "logprob_mismatch", "resolve_model_path", "shard_model",
]
