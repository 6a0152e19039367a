"""VLLMRollout on CPU without vLLM: TIS, the engine's call sequence, configs (requests, output conversion and the
weights the engine is sent: tests/test_vllm_conversion.py).

vLLM's outputs and engine are mirrored by the stand-ins of ``tests/vllm_fakes.py``. When vLLM imports,
``test_real_vllm_types`` repeats the conversion with its own classes (``tests/test_vllm_engine.py`` runs the
real engine).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM

from sgrpo.model.logprobs import logprob_mismatch
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama, ensure_tiny_model
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_engine import INSTALL_HINT, VLLMRollout, engine_rng
from sgrpo.rollout.vllm_requests import rollout_batch_from_outputs, sampling_kwargs
from sgrpo.train.loss import tis_weights
from sgrpo.types import Example
from tests.preloaded import run
from tests.vllm_fakes import (
    EOS,
    FAKE_SUBMODULES,
    PAD,
    FakeLLM,
    install_fake_vllm,
    request,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


# ---------------------------------------------------------------------------------------------- TIS
def test_tis_weights_and_mismatch_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    vllm = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    # log-ratio trainer - vllm = [0.5, -1.0, (masked)]: exp -> [1.6487 capped to 1.5, 0.3679], 0 off the mask
    weights = tis_weights(trainer, vllm, mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-1.0), 0.0]]), atol=1e-8, rtol=1e-5)
    want = torch.tensor([[math.exp(0.5), math.exp(-1), 0]])
    torch.testing.assert_close(tis_weights(trainer, vllm, mask, cap=10.0), want, atol=1e-8, rtol=1e-5)
    # d = vllm - trainer = [-0.5, 1.0]: k3 = exp(-d) - 1 + d = [0.148721, 0.367879] -> mean 0.258300
    stats = logprob_mismatch(trainer, vllm, mask)
    assert stats["kl"].item() == pytest.approx(0.2583, abs=1e-4)
    assert stats["abs_diff"].item() == pytest.approx(0.75)
    trainer_with_grad = trainer.clone().requires_grad_()
    assert not tis_weights(trainer_with_grad, vllm, mask, 2.0).requires_grad  # a constant factor of the loss
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(trainer, vllm, mask, cap=0.0)


# ---------------------------------------------------------------------------------------------- engine
def test_the_step_seed_decides_what_vllm_v2_draws_for_an_unseeded_request():
    """vLLM's V2 model runner (its default on CUDA) gives a request without a seed one drawn from numpy's global RNG
    (``np.random.randint`` over int64 in ``vllm.v1.worker.gpu.sample.states``); under ``engine_rng`` that draw
    follows the step seed alone, whatever numpy's state before, and numpy's state is put back (torch's too)."""
    v2_request_seed = lambda: int(np.random.randint(-(2**63), 2**63 - 1))  # noqa: E731 - vLLM's own call

    def drawn(step_seed: int, outer: int) -> tuple[int, float]:
        np.random.seed(outer)
        torch.manual_seed(outer)
        with engine_rng(step_seed):
            seed, sample = v2_request_seed(), float(torch.rand(()))
        assert v2_request_seed() == (np.random.seed(outer), v2_request_seed())[1]  # numpy's stream carries on
        return seed, sample

    assert drawn(7, outer=0) == drawn(7, outer=1)  # before: numpy's outer state decided the request seeds
    assert drawn(7, outer=0)[0] != drawn(8, outer=0)[0]
    state = np.random.get_state()[1].copy()
    with engine_rng(None):  # greedy or per-request seeds: nothing seeded
        pass
    assert (np.random.get_state()[1] == state).all()


def test_constructor_checks_and_lazy_import(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as on a machine without it
    engine = VLLMRollout(max_new_tokens=4)  # constructing needs no vLLM
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'") as err:
        engine.generate(build_tiny_llama(tokenizer), tokenizer, [Example(prompt="s:1=", answer="1")], 2)
    assert INSTALL_HINT in str(err.value)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        VLLMRollout(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_model_len must exceed"):
        VLLMRollout(max_new_tokens=64, max_model_len=32)


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # restored after the test
    for name in FAKE_SUBMODULES:
        monkeypatch.setitem(sys.modules, name, None)
    module = install_fake_vllm(FakeLLM)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine exports RANK/WORLD_SIZE/...: keep them local
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    return module


def test_generate_syncs_weights_sleeps_and_wakes_in_order(fake_vllm, model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = build_char_tokenizer()
    examples = [Example(prompt="s:31=", answer="13"), Example(prompt="s:402=", answer="024")]
    engine = VLLMRollout(max_new_tokens=3, temperature=0.8, gpu_memory_utilization=0.4, seed=5, seed_per_request=True)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the policy moved away from the checkpoint the engine loaded
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, examples, group_size=2)
    llm = engine._llm
    assert llm.path == model_dir and llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.kwargs["enable_sleep_mode"] and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["seed"] == 5 and llm.kwargs["gpu_memory_utilization"] == 0.4 and llm.kwargs["dtype"] == "bfloat16"
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"  # a lone process
    assert llm.events == ["load", "reset", "generate", "sleep1"]  # new engine: awake, no wake-up
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert all(torch.equal(llm.engine_model.state_dict()[k], v) for k, v in expected.items())
    params = llm.params
    settings = [(p.n, p.max_tokens, p.temperature, p.logprobs, p.stop_token_ids) for p in params]
    assert settings == [(2, 3, 0.8, 0, [EOS])] * 2
    torch.manual_seed(0)
    assert [p.seed for p in params] == torch.randint(2**31 - 1, (2,)).tolist()  # drawn from torch's RNG
    # rows: prompt b, completion g; even g stop at <eos>, odd g run to max_new_tokens
    assert batch.completion_mask.tolist() == [[True, True, False], [True] * 3] * 2
    assert batch.truncated.tolist() == [False, True, False, True]
    torch.testing.assert_close(batch.logprobs[1], torch.tensor([-0.1, -0.2, -0.3]), atol=1e-8, rtol=1e-5)
    assert batch.completions[1] == "111"

    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)  # an optimiser step
    llm.events.clear()
    greedy = engine.generate(model, tokenizer, examples[:1], group_size=3, greedy=True)
    assert llm.events == ["wake:weights", "load", "reset", "wake:kv_cache", "generate", "sleep1"]
    assert torch.equal(llm.engine_model.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    assert llm.params[0].n == 1 and llm.params[0].temperature == 0.0
    assert greedy.input_ids.shape[0] == 3 and len(set(greedy.completions)) == 1  # one argmax completion, 3 rows


def tracked_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    bump_weights_version(model)  # as GRPOPolicy's optimiser steps do
    return model


EXAMPLES_2 = [Example(prompt="s:31=", answer="13"), Example(prompt="s:402=", answer="024")]
STEP = ["wake:weights", "load", "reset", "wake:kv_cache", "generate", "sleep1"]


def test_sync_is_skipped_while_the_weights_version_is_unchanged(fake_vllm, model_dir):
    model, tokenizer = tracked_model(model_dir), build_char_tokenizer()
    engine = VLLMRollout(max_new_tokens=2)
    engine.generate(model, tokenizer, EXAMPLES_2, 2)
    llm = engine._llm
    assert llm.events == ["load", "reset", "generate", "sleep1"]
    llm.events.clear()
    engine.generate(model, tokenizer, EXAMPLES_2, 2)  # no optimiser step since: the engine's weights are current
    assert llm.events == ["wake:weights", "wake:kv_cache", "generate", "sleep1"]
    llm.events.clear()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    bump_weights_version(model)  # an optimiser step
    engine.generate(model, tokenizer, EXAMPLES_2, 2)
    assert llm.events == STEP
    assert torch.equal(llm.engine_model.model.norm.weight, model.model.norm.weight)
    other = tracked_model(model_dir)  # another model at the same version number is synced
    llm.events.clear()
    engine.generate(other, tokenizer, EXAMPLES_2, 2)
    assert llm.events == STEP


def test_engine_stays_awake_and_synced_once_through_a_validation(fake_vllm, model_dir):
    model, tokenizer = tracked_model(model_dir), build_char_tokenizer()
    engine = VLLMRollout(max_new_tokens=2)
    engine.generate(model, tokenizer, EXAMPLES_2, 2)  # a training step leaves the engine asleep
    bump_weights_version(model)
    llm = engine._llm
    llm.events.clear()
    engine.hold()  # PolicyEvaluation.on_validation_epoch_start
    for _ in range(3):
        engine.generate(model, tokenizer, EXAMPLES_2, 2, greedy=True)
    engine.release()  # on_validation_epoch_end
    assert llm.events == STEP[:-1] + ["generate", "generate", "sleep1"]


def test_device_cache_is_emptied_before_each_wake_up(fake_vllm, model_dir, monkeypatch):
    """The weight sync's freed blocks go back to the device before the KV cache is mapped again."""
    model, tokenizer = tracked_model(model_dir), build_char_tokenizer()
    engine = VLLMRollout(max_new_tokens=2)
    engine.generate(model, tokenizer, EXAMPLES_2, 2)
    llm = engine._llm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.events.append("empty_cache"))
    bump_weights_version(model)
    llm.events.clear()
    engine.generate(model, tokenizer, EXAMPLES_2, 2)
    assert llm.events == ["empty_cache", "wake:weights", "load", "reset", "empty_cache", "wake:kv_cache",
                          "generate", "sleep1"]  # fmt: skip


def test_engine_is_seeded_per_step_without_per_request_seeds(fake_vllm, model_dir):
    """Default: no per-request seeds (vLLM's batched sampler); the engine's generators are seeded from torch's RNG,
    so the policy's per-step seed reproduces the draws, and the caller's RNG state is left as one draw moved it."""
    model, tokenizer = tracked_model(model_dir), build_char_tokenizer()
    engine = VLLMRollout(max_new_tokens=2)
    assert engine.seed_per_request is False
    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        engine.generate(model, tokenizer, EXAMPLES_2, 2)
        draws.append(engine._llm.draws[-1])
        after = torch.rand(1)
        torch.manual_seed(seed)
        torch.randint(2**31 - 1, (1,))  # the engine's one draw from the caller's generator
        assert torch.equal(after, torch.rand(1))
    assert all(p.seed is None for p in engine._llm.params)
    assert draws[0] == draws[1] != draws[2]


def test_sync_reports_engine_parameters_left_without_a_value(fake_vllm, model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = VLLMRollout(max_new_tokens=2, sleep=False)
    llm = engine._engine(model)
    llm.engine_model.register_parameter("extra", nn.Parameter(torch.zeros(1)))  # a parameter the policy lacks
    with pytest.raises(RuntimeError, match=r"1 vLLM parameters got no value.*'extra'"):
        engine.sync_weights(model)


@pytest.mark.slow
def test_fit_with_the_engine_under_fsdp2(model_dir, tmp_path):
    """GRPOPolicy + VLLMRollout (on a sampling stand-in for vllm.LLM) + FSDP2: the engine follows the policy."""
    code = f"from tests.vllm_fakes import fit_with_engine; fit_with_engine({model_dir!r}, {str(tmp_path)!r})"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=300)  # forked preloaded (tests/preloaded.py)
    assert done.returncode == 0, done.stderr[-4000:]
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["sharded"] and info["moved"] and info["engine_equals_trainer"]
    step = ["wake:weights", "load", "reset", "wake:kv_cache", "generate", "sleep1"]
    assert info["events"] == ["load", "reset", "generate", "sleep1"] + step * 2  # 2 training steps, then one more
    assert info["kl"] < 1e-6  # the engine's log-probs are the trainer's: the TIS weights would all be 1
    for key, value in info["logged"].items():  # train/rollout/mismatch_kl, .../mismatch_abs_diff, .../tis_weight_mean
        assert value == pytest.approx(1.0 if key.endswith("tis_weight_mean") else 0.0, abs=1e-5), key


@pytest.mark.vllm
def test_real_vllm_types(tokenizer):
    vllm = pytest.importorskip("vllm")
    from vllm.outputs import CompletionOutput

    try:
        from vllm.logprobs import Logprob
    except ImportError:  # older releases
        from vllm.sequence import Logprob
    kwargs = sampling_kwargs(group_size=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                             stop_token_ids=[EOS], seed=3)  # fmt: skip
    params = vllm.SamplingParams(**kwargs)
    assert (params.n, params.max_tokens, params.logprobs, params.seed) == (2, 4, 0, 3)
    outs = [
        CompletionOutput(index=i, text="", token_ids=ids, cumulative_logprob=None,
                         logprobs=[{t: Logprob(logprob=-0.5)} for t in ids], finish_reason=reason)
        for i, (ids, reason) in enumerate([([8, EOS], "stop"), ([9, 9, 9, 9], "length")])
    ]  # fmt: skip
    batch = rollout_batch_from_outputs([request([4, 5], outs)], 2, PAD, tokenizer)
    assert batch.completions == ["5", "6666"] and batch.truncated.tolist() == [False, True]
    assert batch.logprobs.tolist() == [[-0.5, -0.5, 0.0, 0.0], [-0.5] * 4]


# ---------------------------------------------------------------------------------------------- configs
def test_vllm_rollout_is_named_in_yaml_and_instantiated_without_vllm(monkeypatch, model_dir, tmp_path):
    from sgrpo.fit import parse

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.chdir(REPO)
    raw = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    raw["model"]["rollout"] = {
        "class_path": "sgrpo.rollout.VLLMRollout",
        "init_args": {"max_new_tokens": 8, "gpu_memory_utilization": 0.25},
    }
    raw["model"]["loss"] = {
        "class_path": "sgrpo.train.ClippedSurrogate",
        "init_args": {"importance_sampling_cap": None},
    }
    config = tmp_path / "vllm.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit):  # a fit would need vLLM: refused before the model loads (tests/test_faults_input)
        parse(["--config", str(config), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path}"])
    monkeypatch.setattr(VLLMRollout, "preflight", lambda self: None)  # the parse itself, past that check
    cli = parse(["--config", str(config), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path}"])
    rollout = cli.model.rollout
    assert isinstance(rollout, VLLMRollout) and rollout._llm is None
    assert (rollout.max_new_tokens, rollout.gpu_memory_utilization) == (8, 0.25)
    assert cli.model.loss.importance_sampling_cap is None
    raw["model"]["rollout"]["init_args"]["gpu_memory_utilisation"] = 0.3  # a typo fails at parse time
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit):
        parse(["--config", str(config), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path}"])


@pytest.mark.parametrize("name", ["scale_deepmath_8gpu.yaml", "scale_deepmath_multinode.yaml"])
def test_scale_configs_keep_the_deepmath_model_task_and_estimator(name):
    reference = yaml.safe_load((REPO / "configs/deepmath_softmax.yaml").read_text())["model"]
    raw = yaml.safe_load((REPO / "configs" / name).read_text())
    for key in ("model", "task", "estimator"):
        assert raw["model"][key] == reference[key], key
    assert raw["model"]["rollout"]["class_path"] == "sgrpo.rollout.VLLMRollout"
    assert raw["trainer"]["strategy"]["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
