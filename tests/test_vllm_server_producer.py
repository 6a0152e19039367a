"""The async producer on vLLM servers (``sgrpo.rollout.server_producer.ServerProducer``) on CPU without vLLM, against
stand-in servers (``tests/fake_vllm_server.py``): admitted steps sent as the synchronous engine would, requests kept
across pushes with their version spans, dying servers named, refills and ``sync_every``, fits through it. The real
server: ``tests/test_vllm_server.py``; the engine's HTTP side: ``tests/test_vllm_server_client.py``."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sgrpo.rollout.engine import bump_weights_version
from sgrpo.rollout.producer import ProducerError
from sgrpo.rollout.server_producer import ServerProducer
from sgrpo.rollout.vllm_server import VLLMServerRollout
from sgrpo.types import Example
from tests.test_vllm_server_client import sent
from tests.test_vllm_server_client import servers as servers  # fixtures
from tests.test_vllm_server_client import tiny as tiny


# ---------------------------------------------------------------------------------------------- the async producer
def step_prompts(step: int) -> list[Example]:
    return [Example(prompt=f"s:{step}1=", answer="1"), Example(prompt=f"s:{step}23=", answer="23")]


def texts(step: int) -> list[str]:
    return [ex.prompt for ex in step_prompts(step)]


def producer_of(engine, model, tokenizer, staleness: int, timeout: float = 10.0) -> ServerProducer:
    return ServerProducer(engine, model, tokenizer, step_prompts, lambda step: 100 + step, group_size=2,
                          max_staleness=staleness, start_step=0, end_step=4, timeout=timeout)  # fmt: skip


def test_the_server_producer_sends_each_admitted_step_as_the_synchronous_engine_would(servers, tiny):
    """Step s is sent once s <= v + S, with the synchronous path's token ids and seeds, salted with the version
    the servers hold; each push pauses with requests kept."""
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32")
    bump_weights_version(model)
    torch.manual_seed(100)  # step 0's seed: the synchronous engine's requests of step 0
    engine.generate(model, tokenizer, step_prompts(0), group_size=2)
    synchronous = sent(server)
    producer = producer_of(engine, model, tokenizer, staleness=1)
    block = producer.take(0, texts(0))
    assert sorted(producer._jobs) == [1]  # step 1 sent (1 <= 0 + 1), step 2 not
    producer.take(1, texts(1))
    asynchronous = sent(server)[len(synchronous):]
    step0 = [r for r in asynchronous if r["token_ids"] in [s["token_ids"] for s in synchronous]]
    assert sorted((r["token_ids"], r["sampling_params"]["seed"]) for r in step0) == sorted(
        (r["token_ids"], r["sampling_params"]["seed"]) for r in synchronous)
    assert {r["cache_salt"] for r in asynchronous} == {engine._pushed} and len(asynchronous) == 4
    assert block.rollout.versions.tolist() == [0] * 4 and block.rollout.newest_versions.tolist() == [0] * 4
    bump_weights_version(model)
    producer.push(None, 1)  # version 1: step 2 is admitted, under the new weights' salt
    assert sorted(producer._jobs) == [2]
    assert [p for p, _ in server.calls if p.startswith("/pause")][-1] == "/pause?mode=keep&clear_cache=false"
    producer.take(2, texts(2))
    assert sent(server)[-1]["cache_salt"] == engine._pushed != synchronous[0]["cache_salt"]
    producer.close()


def test_requests_kept_across_a_push_record_every_version_their_groups_span(servers, tiny):
    model, tokenizer = tiny
    server = servers()
    server.hold = threading.Event()  # steps 0 and 1 stay in flight across the push
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32")
    producer = producer_of(engine, model, tokenizer, staleness=1)
    deadline = time.monotonic() + 10
    while len(sent(server)) < 4 and time.monotonic() < deadline:  # every request of steps 0 and 1 at the server
        time.sleep(0.01)
    bump_weights_version(model)
    producer.push(None, 1)
    server.hold.set()
    for step in (0, 1):  # the first token under version 0, the rest under 1: oldest 0 (staleness), newest 1
        rollout = producer.take(step, texts(step)).rollout
        assert rollout.versions.tolist() == [0] * 4 and rollout.newest_versions.tolist() == [1] * 4
    assert producer.take(2, texts(2)).rollout.newest_versions.tolist() == [1] * 4  # sent after the push
    producer.close()
    waiting = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32", async_pause="wait")
    producer = producer_of(waiting, model, tokenizer, staleness=0)
    bump_weights_version(model)
    producer.take(0, texts(0))
    producer.push(None, 1)
    assert [p for p, _ in server.calls if p.startswith("/pause")][-1] == "/pause?mode=wait&clear_cache=true"
    producer.close()


def take_raises_within(producer: ServerProducer, pattern: str, seconds: float) -> None:
    start = time.monotonic()
    with pytest.raises(ProducerError, match=pattern):
        producer.take(0, texts(0))
    assert time.monotonic() - start < seconds


def test_a_server_that_dies_hangs_or_restarts_under_the_producer_raises_naming_it(servers, tiny):
    model, tokenizer = tiny
    dying, hung, restarted = servers(), servers(), servers()
    for server in (dying, hung, restarted):
        server.hold = threading.Event()  # requests stay in flight
    engine = VLLMServerRollout(urls=[dying.url], max_new_tokens=4, health_timeout=1)
    producer = producer_of(engine, model, tokenizer, staleness=1)
    dying.stop()  # /health refused, and the requests held in flight are cut: whichever the producer sees first
    take_raises_within(producer, f"{dying.url}(/health: unreachable|/inference/v1/generate: connection lost)", 4)
    engine = VLLMServerRollout(urls=[hung.url], max_new_tokens=4)
    take_raises_within(producer_of(engine, model, tokenizer, staleness=1, timeout=1),
                       f"no answers for step 0 within 1 s .*in flight to {hung.url}", 3)  # fmt: skip
    producer = producer_of(VLLMServerRollout(urls=[restarted.url], max_new_tokens=4), model, tokenizer, staleness=1)
    restarted.version = "default"  # it lost the weights while the requests waited
    restarted.hold.set()
    take_raises_within(producer, f"{restarted.url}: sampled with weight versions \\['default'\\], which", 3)
    dying.hold.set()
    hung.hold.set()


def refill_prompts(step: int, sampling_round: int) -> list[Example]:
    return [Example(prompt=f"s:{step}{sampling_round}9=", answer="9"), Example(prompt=f"s:{step}87=", answer="78")]


def seeds(step: int, sampling_round: int = 0) -> int:
    return 100 + step + 10 * sampling_round


def wait_for(condition, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_refill_rounds_leave_before_later_steps_with_the_synchronous_prompts_and_seeds(servers, tiny):
    """Dynamic sampling's round r of step s: the refill stream's prompts, seeded from (s, r) as the synchronous
    engine draws them, sent ahead of the requests of later steps still queued, its block tagged with its round."""
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32", max_concurrency=1)
    bump_weights_version(model)
    torch.manual_seed(seeds(0, 1))  # the synchronous engine's refill requests of round 1 of step 0
    engine.generate(model, tokenizer, refill_prompts(0, 1), group_size=2)
    synchronous = sorted((r["token_ids"], r["sampling_params"]["seed"]) for r in sent(server))
    before = len(sent(server))
    server.hold = threading.Event()
    producer = ServerProducer(engine, model, tokenizer, step_prompts, seeds, group_size=2, max_staleness=2,
                              start_step=0, end_step=4, timeout=10, refill_prompts=refill_prompts)  # fmt: skip
    wait_for(lambda: len(sent(server)) == before + 1)  # one request at the server (one sender), steps 0-2 queued
    refill_texts = [ex.prompt for ex in refill_prompts(0, 1)]
    threading.Thread(target=lambda: (wait_for(lambda: producer._work.qsize() == 7), server.hold.set())).start()
    block = producer.refill(0, 1, refill_texts)
    assert block.sampling_round == 1 and block.prompts == refill_texts and block.rollout.num_groups == 2
    assert block.rollout.versions.tolist() == [0] * 4
    for step in (0, 1, 2):
        producer.take(step, texts(step))
    order = [(r["token_ids"], r["sampling_params"]["seed"]) for r in sent(server)[before:]]
    assert sorted(order[2:4]) == synchronous  # after step 0's two requests (the first already sent): the refill
    step_ids = [engine_ids(tokenizer, step_prompts(step)) for step in (0, 1, 2)]
    assert [ids for ids, _ in order[:2]] == step_ids[0] and [ids for ids, _ in order[4:]] == step_ids[1] + step_ids[2]
    with pytest.raises(ProducerError, match="refill round 2 of step 3 has other prompts"):
        producer.refill(3, 2, refill_texts)
    producer.close()
    with pytest.raises(ProducerError, match="without dynamic sampling's refill prompts"):
        producer_of(engine, model, tokenizer, staleness=0).refill(0, 1, refill_texts)


def engine_ids(tokenizer, examples: list[Example]) -> list[list[int]]:
    from sgrpo.rollout.vllm_requests import prompt_token_ids

    return prompt_token_ids(tokenizer, examples)


def test_between_pushes_of_sync_every_a_validation_push_is_adopted_and_admission_counts_from_the_last_push(
    servers, tiny
):
    """With ``sync_every`` = 2 the trainer pushes every second step; a validation between pushes makes the engine
    push the trainer's weights itself: requests sent after it (here a refill) record the trainer's version of that
    moment instead of raising as answers from weights this trainer did not push; step 2 waits for the push."""
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32")
    trainer = {"version": 0}
    producer = ServerProducer(engine, model, tokenizer, step_prompts, seeds, group_size=2, max_staleness=1,
                              start_step=0, end_step=4, timeout=10, refill_prompts=refill_prompts,
                              trainer_version=lambda: trainer["version"])  # fmt: skip
    producer.take(0, texts(0))
    trainer["version"] = 1  # step 0 trained, not pushed (1 % 2 != 0)
    bump_weights_version(model)
    engine.generate(model, tokenizer, step_prompts(9), group_size=2)  # validation: the engine pushes first
    assert engine.syncs == 2 and sorted(producer._jobs) == [1]  # step 1 sent before it; step 2 not admitted
    assert producer.take(1, texts(1)).rollout.versions.tolist() == [0] * 4
    block = producer.refill(1, 1, [ex.prompt for ex in refill_prompts(1, 1)])
    assert block.rollout.versions.tolist() == [1] * 4 and sent(server)[-1]["cache_salt"] == engine._pushed
    trainer["version"] = 2
    bump_weights_version(model)
    producer.push(None, 2)
    assert sorted(producer._jobs) == [2, 3]
    producer.close()


def test_requests_queued_across_a_push_are_salted_with_the_version_they_run_under(servers, tiny):
    """A request that waits in this process's queue (``max_concurrency``) while a push lands leaves after it,
    salted with the new version: it never reads a prompt cache computed under the weights before."""
    model, tokenizer = tiny
    server = servers()
    server.hold = threading.Event()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32", max_concurrency=1)
    producer = producer_of(engine, model, tokenizer, staleness=1)
    wait_for(lambda: len(sent(server)) == 1)  # step 0's first request at the server, three queued
    old = engine._pushed
    bump_weights_version(model)
    producer.push(None, 1)
    server.hold.set()
    for step in (0, 1, 2):
        producer.take(step, texts(step))
    assert [r["cache_salt"] for r in sent(server)] == [old] + [engine._pushed] * 5 and old != engine._pushed
    producer.close()


def test_at_staleness_0_a_step_leaves_when_the_trainer_takes_it(servers, tiny):
    """At S = 0 step s + 1 was sent right after the push of version s + 1, so a validation the trainer ran next
    shared the servers' batches with it (vLLM's numerics depend on the batch: not the synchronous run's samples);
    now each step leaves when the trainer takes it, after whatever ran in between."""
    model, tokenizer = tiny
    server = servers()
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32")
    producer = producer_of(engine, model, tokenizer, staleness=0)
    time.sleep(0.3)
    assert sent(server) == []  # nothing before the trainer asks
    producer.take(0, texts(0))
    assert len(sent(server)) == 2
    bump_weights_version(model)
    producer.push(None, 1)
    time.sleep(0.3)
    assert len(sent(server)) == 2  # the trainer's validation would run now, alone on the servers
    producer.take(1, texts(1))
    assert len(sent(server)) == 4 and {r["cache_salt"] for r in sent(server)[2:]} == {engine._pushed}
    producer.close()


def test_an_answer_without_weight_versions_is_refused_not_counted_current(servers, tiny):
    """A server that reports no weight versions (another server build, a proxy dropping the field) had its rows
    tagged with the trainer's current version: a stale group read as staleness 0, past the bound's check."""
    model, tokenizer = tiny
    server = servers()
    choice = server._choice
    server._choice = lambda *args: {k: v for k, v in choice(*args).items() if k != "weight_versions"}
    engine = VLLMServerRollout(urls=[server.url], max_new_tokens=4, dtype="float32")
    producer = producer_of(engine, model, tokenizer, staleness=1)
    with pytest.raises(ProducerError, match="without the weight versions of its tokens"):
        producer.take(0, texts(0))
    producer.close()


@pytest.mark.slow
def test_a_fit_with_async_rollout_takes_its_groups_from_the_servers_within_the_bound(servers, tmp_path):
    """``--model.async_rollout=true`` with ``VLLMServerRollout``: the server producer feeds every step its groups,
    each push pauses with requests kept, the staleness stays within S = 1 and the version spans are logged."""
    from sgrpo.eval.report import read_run_metrics
    from sgrpo.fit import main

    server = servers()
    rollout = {"class_path": "sgrpo.rollout.VLLMServerRollout",
               "init_args": {"urls": [server.url], "max_new_tokens": 8, "dtype": "float32"}}  # fmt: skip
    main(["--config", "configs/tiny.yaml", f"--model.rollout={json.dumps(rollout)}", "--model.async_rollout=true",
          "--model.max_staleness=1", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--trainer.val_check_interval=1000"])  # fmt: skip
    metrics = read_run_metrics(tmp_path)
    assert [v for _, v in metrics["train/async/staleness_max"]] == [0.0, 1.0, 1.0]  # step s sent at version s - 1
    assert [v for _, v in metrics["train/async/groups"]] == [4.0] * 3
    assert [v for _, v in metrics["train/async/version_span_mean"]] == [0.0] * 3  # nothing held across a push
    pauses = [p for p, _ in server.calls if p.startswith("/pause")]
    assert pauses[1:] == ["/pause?mode=keep&clear_cache=false"] * 3  # the first push (start) is the engine's own
    assert len(sent(server)) == 3 * 4  # every prompt of every step, once



def sorting_answers(tokenizer):
    """A stand-in server's answers to configs/tiny.yaml's sort prompts: each choice right or wrong by a hash of its
    request's seed and its index, so rewards vary within some groups and not in others (dynamic sampling refills),
    and a request with another seed answers otherwise."""
    import random

    def answer(payload, index: int) -> list[int]:
        digits = tokenizer.decode(payload["token_ids"]).split(":")[1].rstrip("=")
        right = random.Random(payload["sampling_params"]["seed"] * 8 + index).random() < 0.2
        text = "".join(sorted(digits)) if right else digits[::-1] + "0"
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    return answer


@pytest.mark.slow
def test_a_fit_with_dynamic_sampling_and_sync_every_through_the_server_producer(servers, tmp_path):
    """``--model.async_rollout=true`` with ``VLLMServerRollout``, dynamic sampling and ``sync_every``: at S = 0 the
    requests (prompt ids and seeds, refills included), every logged value but timings and the final weights are the
    synchronous server run's, which refills at least once; at S = 1 with ``sync_every`` = 2 the trainer pushes
    after every second step only, every group is within the bound and every round's groups are counted."""
    from transformers import AutoTokenizer

    from sgrpo.eval.report import read_run_metrics
    from sgrpo.fit import main
    from tests.test_async import TIMED, same_weights

    server = servers()
    server.answer = sorting_answers(AutoTokenizer.from_pretrained("sgrpo/assets/quickstart_model"))
    rollout = {"class_path": "sgrpo.rollout.VLLMServerRollout",
               "init_args": {"urls": [server.url], "max_new_tokens": 8, "dtype": "float32"}}  # fmt: skip

    def fit(name: str, *extra: str, steps: int = 3) -> tuple[dict, list]:
        first = len(server.calls)
        main(["--config", "configs/tiny.yaml", f"--model.rollout={json.dumps(rollout)}",
              "--model.dynamic_sampling=true", "--model.max_sampling_rounds=3", f"--trainer.default_root_dir="
              f"{tmp_path / name}", f"--trainer.max_steps={steps}", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false", "--trainer.val_check_interval=1000", *extra])  # fmt: skip
        requests = [(r["token_ids"], r["sampling_params"]["seed"]) for p, r in server.calls[first:]
                    if p == "/inference/v1/generate"]  # fmt: skip
        return read_run_metrics(tmp_path / name), sorted(requests)

    sync, sync_requests = fit("sync")
    assert max(v for _, v in sync["train/sampling/rounds"]) > 1  # a refill ran
    stale0, stale0_requests = fit("async0", "--model.async_rollout=true", "--model.max_staleness=0")
    untimed = [{k: v for k, v in m.items() if not k.startswith(TIMED)} for m in (sync, stale0)]
    assert untimed[0] == untimed[1] and stale0_requests == sync_requests
    assert same_weights(tmp_path / "sync", tmp_path / "async0")
    pauses = len([p for p, _ in server.calls if p.startswith("/pause")])
    stale1, _ = fit("async1", "--model.async_rollout=true", "--model.max_staleness=1", "--model.sync_every=2",
                    steps=4)  # fmt: skip
    keep = [p for p, _ in server.calls if p.startswith("/pause")][pauses:]
    assert keep.count("/pause?mode=keep&clear_cache=false") == 2  # after steps 2 and 4 only
    print(f"\n[figures] rounds: sync {[v for _, v in sync['train/sampling/rounds']]}, S = 1 with sync_every = 2 "
          f"{[v for _, v in stale1['train/sampling/rounds']]}; staleness {stale1['train/async/staleness_max']}")
    # no push at version 1: step 2 waits for version 2's push (with sync_every = 1 it leaves at version 1: lag 1)
    assert [v for _, v in stale1["train/async/staleness_max"]] == [0.0, 1.0, 0.0, 1.0]
    rounds = [v for _, v in stale1["train/sampling/rounds"]]
    assert [v for _, v in stale1["train/async/groups_sampled"]] == [4.0 * r for r in rounds] and len(rounds) == 4


def test_newest_versions_travel_with_their_rows_and_need_versions():
    import dataclasses

    from sgrpo.types import RolloutBatch

    n = 4
    batch = RolloutBatch(torch.zeros(n, 5, dtype=torch.long), torch.ones(n, 5, dtype=torch.long),
                         torch.ones(n, 3, dtype=torch.bool), ["x"] * n, torch.zeros(n, dtype=torch.bool), 2,
                         versions=torch.tensor([0, 0, 1, 1]), newest_versions=torch.tensor([1, 1, 2, 2]))  # fmt: skip
    assert batch.select_groups(torch.tensor([1, 0])).newest_versions.tolist() == [2, 2, 1, 1]
    assert RolloutBatch.cat([batch, batch]).newest_versions.tolist() == [1, 1, 2, 2] * 2
    assert RolloutBatch.cat([batch, dataclasses.replace(batch, newest_versions=None)]).newest_versions is None
    with pytest.raises(ValueError, match="newest_versions must be"):
        dataclasses.replace(batch, versions=None)
