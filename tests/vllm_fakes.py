"""Stand-ins for vLLM on machines without it: its output types, an ``LLM`` that samples by rule or from its own
weights, and the submodules ``VLLMRollout`` imports (``install_fake_vllm``); ``fit_with_engine``, a fit with the
one that samples, run in a process of its own by ``tests/test_vllm_rollout.py``.

vLLM's outputs are mirrored with the documented fields (vllm.outputs, 0.10-0.32):
  RequestOutput.prompt_token_ids: list[int]; RequestOutput.outputs: list[CompletionOutput]
  CompletionOutput.index: int, .text: str, .token_ids: list[int], .finish_reason: "stop" | "length" | None,
      .logprobs: list[dict[int, Logprob]] | None  (one dict per generated token; logprobs=0 -> the sampled one)
  Logprob.logprob: float, .rank: int | None, .decoded_token: str | None
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from sgrpo.model.logprobs import completion_logprobs, logprob_mismatch
from sgrpo.rollout import completion_mask_until_eos
from sgrpo.rollout.vllm_engine import VLLMRollout
from sgrpo.rollout.weightsync import engine_weights
from tasks.base import Reward, RewardResult

EOS, PAD = 2, 0  # the char tokenizer: <pad> 0, <bos> 1, <eos> 2, "0".."9" -> 3..12, "+" 13, "=" 14, ":" 15, "s" 16


def logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=1, decoded_token=None)


def completion(index, token_ids, logprobs, finish_reason, text="") -> SimpleNamespace:
    steps = None if logprobs is None else [{t: logprob(v)} for t, v in zip(token_ids, logprobs)]
    return SimpleNamespace(index=index, text=text, token_ids=token_ids, logprobs=steps, finish_reason=finish_reason)


def request(prompt_token_ids, outputs) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt_token_ids, outputs=outputs)


class FakeLLM:
    """Stands in for ``vllm.LLM``: records calls, holds an HF model as the engine's, samples by rule.

    Completion g of a request: tokens [3 + (seed + g) % 10, <eos>] for even g; max_tokens tokens of "1"
    (truncated) for odd g; the k-th token's log-prob is -0.1 * (k + 1).
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.path, self.kwargs, self.events = model, kwargs, []
        self.engine_model = AutoModelForCausalLM.from_pretrained(model)
        model_config = SimpleNamespace(dtype=torch.float32)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config),
                                          engine_core=SimpleNamespace(shutdown=lambda: self.events.append("shutdown")))
        params = dict(self.engine_model.named_parameters())

        def load_weights(weights):
            names = set()
            for name, value in weights:
                params[name].data.copy_(value)
                names.add(name)
            self.events.append("load")
            return names

        self.engine_model.load_weights = load_weights

    def apply_model(self, func):
        return [func(self.engine_model)]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.events.append("generate")
        self.params = sampling_params
        self.draws = [*getattr(self, "draws", []), torch.rand(1).item()]  # what an unseeded request's sampler draws
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            outs = []
            for g in range(params.n):
                ids = [3 + ((getattr(params, "seed", 0) or 0) + g) % 10, EOS] if g % 2 == 0 else [4] * params.max_tokens
                lps = [-0.1 * (k + 1) for k in range(len(ids))]
                outs.append(completion(g, ids, lps, "stop" if g % 2 == 0 else "length"))
            outputs.append(request(prompt["prompt_token_ids"], outs))
        return outputs

    def sleep(self, level):
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake:{','.join(tags)}")

    def reset_prefix_cache(self):
        self.events.append("reset")


class SamplingLLM(FakeLLM):
    """A faithful stand-in: samples from its own (synced) weights and reports their log-probs, as vLLM does."""

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.events.append("generate")
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            ids = torch.tensor([prompt["prompt_token_ids"]] * params.n)  # [n, P]
            if params.seed is not None:  # else the process's generator, which VLLMRollout seeds per step
                torch.manual_seed(params.seed)
            out = self.engine_model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=params.temperature,
                top_k=0, max_new_tokens=params.max_tokens, eos_token_id=params.stop_token_ids, pad_token_id=PAD,
            )  # fmt: skip
            mask, truncated = completion_mask_until_eos(out[:, ids.shape[1] :], params.stop_token_ids)  # [n, T]
            attention = torch.cat([torch.ones_like(ids), mask.long()], 1)
            lp, _ = completion_logprobs(self.engine_model, out, attention, mask, params.temperature)
            new = out[:, ids.shape[1] :]
            outs = [
                completion(g, new[g][mask[g]].tolist(), lp[g][mask[g]].tolist(), "length" if truncated[g] else "stop")
                for g in range(params.n)
            ]
            outputs.append(request(prompt["prompt_token_ids"], outs))
        return outputs


#: the vLLM modules VLLMRollout imports besides ``vllm``: (name, attributes); the layerwise reload's two steps
#: do nothing here (the fake engine's parameters are plain and loaded in place)
FAKE_SUBMODULES = {
    "vllm.config": {"set_current_vllm_config": lambda config: contextlib.nullcontext()},
    "vllm.platforms": {"current_platform": SimpleNamespace(is_sleep_mode_available=lambda: True)},
    "vllm.model_executor.model_loader.reload": {
        "initialize_layerwise_reload": lambda model: None,
        "finalize_layerwise_reload": lambda model, model_config: None,
    },
}


def install_fake_vllm(llm_class) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = llm_class
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    sys.modules["vllm"] = module
    for name, attributes in FAKE_SUBMODULES.items():
        sys.modules[name] = types.ModuleType(name)
        vars(sys.modules[name]).update(attributes)
    return module


class Parity(Reward):
    """1 if a completion's first character has an odd code point: a binary reward with variance for a random model."""

    name = "parity"

    def score(self, examples, completions) -> RewardResult:
        total = torch.tensor([float(ord((c or "0")[0]) % 2) for c in completions], dtype=torch.float32)
        return RewardResult(total, {self.name: total})


def fit_with_engine(model_dir: str, out: str) -> None:
    """Run in a fresh interpreter by the test below: 2 steps of GRPOPolicy, FSDP2 (1 process, gloo), SamplingLLM."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from estimators import GRPO
    from sgrpo.policy import GRPOPolicy
    from tasks.synthetic import SyntheticTask

    llm_class = type("RecordingSamplingLLM", (SamplingLLM,), {})
    install_fake_vllm(llm_class)
    task = SyntheticTask(kind="sort", levels=[3], num_train=16, num_validation=0, num_test=0, reward=Parity())
    policy = GRPOPolicy(model=model_dir, task=task, estimator=GRPO(), rollout=VLLMRollout(max_new_tokens=4),
                        group_size=4, prompts_per_step=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))  # fmt: skip
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(data_parallel_size=1,
                      tensor_parallel_size=1), max_steps=2, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=out)  # fmt: skip
    trainer.fit(policy)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/rollout/")}
    engine, model = policy.rollout, policy.model
    sharded = all(hasattr(p, "full_tensor") for p in model.parameters())  # before a forward leaves the root unsharded
    batch = engine.generate(model, policy.tokenizer, list(task.examples("train"))[:2], 4)  # syncs the last update
    trained = dict(engine_weights(model))  # FSDP2 shards gathered
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    engine_params = dict(engine._llm.engine_model.named_parameters())
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    info = {
        "sharded": sharded,
        "moved": any(not torch.equal(v, initial[k]) for k, v in trained.items()),
        "engine_equals_trainer": all(torch.equal(engine_params[k], v) for k, v in trained.items()),
        "events": engine._llm.events,
        "kl": logprob_mismatch(logp, batch.logprobs, batch.completion_mask)["kl"].item(),
        "logged": logged,  # the policy's TIS metrics, once it applies the correction
    }
    Path(out, "info.json").write_text(json.dumps(info))
