"""The asynchronous rollouts' producer process as a process: it starts for a model of hundreds of tensors, it is
stopped when a fit raises, it cleans up after a trainer that is gone, a push never waits on a lock a killed
producer holds and copies each weight as it comes, the engine it is sent carries no model, and it samples in the
trainer's precision (S = 0 under bf16 is the synchronous run; under FSDP2 bf16-mixed its weights in the synchronous
rollout copy's dtypes). The path's equalities and bounds: tests/test_async.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from estimators import SoftmaxGRPO
from sgrpo.model.lora import plain_weights
from sgrpo.policy import GRPOPolicy
from sgrpo.processes import running
from sgrpo.rollout import HFRollout
from sgrpo.rollout.producer_process import ProducerError
from sgrpo.train.update import PolicyUpdate
from tasks.synthetic import SyntheticTask
from tests.engine_helpers import run_steps
from tests.test_async import REPO, SHIPPED, asynchronous, fit, same_weights, untimed


def test_a_model_of_hundreds_of_tensors_starts_its_producer(tmp_path):
    """30 layers: 281 weight tensors. The fork server passes each shared storage as a file descriptor and refuses 252
    or more: with a shared tensor per weight, the producer of any Qwen2.5 or Llama 3 model could not start."""
    from sgrpo.model.tiny import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model", hidden_size=16, num_layers=30)
    assert len(load_file(str(model / "model.safetensors"))) > 252
    metrics = fit(tmp_path / "run", f"--model.model={model}", *asynchronous(1), steps=2)
    assert len(metrics["train/loss"]) == 2


def started_producers(monkeypatch) -> list:
    """The ``RolloutProducer`` s started from now on, in order."""
    from sgrpo.rollout import producer as producer_module

    started = []
    init = producer_module.RolloutProducer.__init__
    monkeypatch.setattr(producer_module.RolloutProducer, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), started.append(self))[0])  # fmt: skip
    return started


def test_a_fit_that_raises_stops_its_producer_and_leaves_no_block_files(monkeypatch):
    """Lightning runs no ``teardown`` when a fit raises: the producer process and its folder of block files used to
    outlive the fit in the interpreter. A producer whose trainer is gone deletes the folder itself."""
    started = started_producers(monkeypatch)
    update, calls = PolicyUpdate.update, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("an update that fails")
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "update", failing)
    task = SyntheticTask(kind="sort", levels=[3, 5], num_train=64, num_validation=4)
    policy = GRPOPolicy(SHIPPED, task, SoftmaxGRPO(temperature=0.5), HFRollout(max_new_tokens=8), group_size=4,
                        prompts_per_step=4, async_rollout=True, max_staleness=2)  # fmt: skip
    with pytest.raises(RuntimeError, match="an update that fails"):
        run_steps(policy, steps=4)
    (producer,) = started
    assert not producer.process.is_alive() and not os.path.exists(producer.folder) and policy._producer is None


def test_a_signal_to_the_job_s_process_group_leaves_the_producer_sampling(monkeypatch):
    """SIGINT and SIGTERM sent to the whole job (Ctrl-C, a scheduler's preemption) reach the producer too: it used to
    die of them, and its trainer, which stops at the end of the step, raised ``ProducerError`` waiting for the
    step's groups (no checkpoint). The producer ignores them and the steps go on."""
    import signal

    started = started_producers(monkeypatch)
    update, calls = PolicyUpdate.update, []

    def signalled(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            for signum in (signal.SIGINT, signal.SIGTERM):
                os.kill(started[0].process.pid, signum)
            time.sleep(0.5)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "update", signalled)
    task = SyntheticTask(kind="sort", levels=[3, 5], num_train=64, num_validation=4)
    policy = GRPOPolicy(SHIPPED, task, SoftmaxGRPO(temperature=0.5), HFRollout(max_new_tokens=8), group_size=4,
                        prompts_per_step=4, async_rollout=True, max_staleness=0)  # fmt: skip
    run_steps(policy, steps=4)
    assert len(calls) == 4 and policy.rollout_step == 4


@pytest.mark.slow  # a fresh interpreter and its producer: 24-34 s
def test_a_producer_whose_trainer_is_gone_deletes_its_block_folder(tmp_path):
    """The trainer ended without ``close`` (``os._exit``, a kill): its lifeline closes, and the producer removes the
    folder of block files as it ends."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.test_async_producer import orphan_producer\n"
        "if __name__ == '__main__':\n"
        "    orphan_producer()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    folder, pid = done.stdout.split()
    deadline = time.monotonic() + 30
    while (os.path.exists(folder) or running(int(pid))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(folder) and not running(int(pid)), done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.bench  # 18 s (a fresh interpreter and its producer): make test-bench, which CI runs (make test's margin)
def test_an_interpreter_that_exits_without_close_stops_its_producer(tmp_path):
    """A script that never called ``close`` hung for good at its exit: multiprocessing's exit hook SIGTERMs daemon
    children (the producer ignores it) and joins them with no timeout. A finalizer that runs before it closes the
    producer now."""
    script = tmp_path / "forgets.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.test_async_producer import shipped_producer\n"
        "if __name__ == '__main__':\n"
        "    producer, _ = shipped_producer()\n"
        "    print(producer.folder, producer.process.pid, flush=True)\n"
        "    sys.exit(0)\n"
    )
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as hung:
        raise AssertionError("the script hung at its exit") from hung
    assert done.returncode == 0, done.stderr[-2000:]
    folder, pid = done.stdout.split()
    assert not os.path.exists(folder) and not running(int(pid))


def test_a_push_while_a_killed_producer_holds_the_weights_lock_raises_naming_it():
    """A producer killed while copying the weights never releases their lock: the trainer's push used to wait on it
    for good (its other processes in their collectives); it raises once the producer has ended."""
    producer, model = shipped_producer()
    try:
        producer._lock.acquire()  # as the producer holds it while it copies
        producer.process.kill()
        started = time.monotonic()
        with pytest.raises(ProducerError, match="ended with exit code -9 while it copied the weights"):
            producer.push(plain_weights(model, buffers=False), 1)
        assert time.monotonic() - started < 5
    finally:
        producer.close()


def test_a_push_while_a_hung_producer_holds_the_weights_lock_raises_at_the_timeout():
    """A producer alive but stuck inside its weight copy holds the lock for good: the push waited forever (under
    FSDP2 the other processes in their gathers). It raises after ``timeout`` seconds, naming the producer."""
    producer, model = shipped_producer()
    try:
        producer._lock.acquire()  # as a producer stuck in its copy holds it
        producer.timeout = 1.0
        started = time.monotonic()
        with pytest.raises(ProducerError, match=r"has held the weights' lock for 1 s: it hung while it copied"):
            producer.push(plain_weights(model, buffers=False), 1)
        assert time.monotonic() - started < 5 and producer.process.exitcode is None  # alive: hung, not dead
    finally:
        producer._lock.release()
        producer.close()


def shipped_producer():
    """A producer of the shipped model (two prompts a step, steps 0 and 1), and the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgrpo.rollout.producer import RolloutProducer
    from sgrpo.rollout.producer_process import ProducerSpec

    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    spec = ProducerSpec(model_path=SHIPPED, dtype="float32", tokenizer=AutoTokenizer.from_pretrained(SHIPPED),
                        engine=HFRollout(max_new_tokens=4), prompts=two_prompts, seed_of=zero_seed, group_size=2,
                        max_staleness=1, start_step=0, end_step=2, threads=1)  # fmt: skip
    return RolloutProducer(spec, plain_weights(model, buffers=False), timeout=60), model


def orphan_producer() -> None:
    """(A child process of the test above.) Start a producer, wait until it queued a block file, print its folder
    and pid, and end without ``close``."""
    producer, _ = shipped_producer()
    deadline = time.monotonic() + 60
    while not any(name.endswith(".pt") for name in os.listdir(producer.folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(producer.folder, producer.process.pid, flush=True)
    os._exit(0)


def two_prompts(step: int):
    return list(SyntheticTask(kind="sort", levels=[3, 5], num_train=16, num_validation=4).examples("train")[:2])


def zero_seed(*_) -> int:
    return 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_staleness_0_under_bf16_is_the_synchronous_run(precision, tmp_path):
    """The producer samples in the trainer's precision (bf16-mixed: under autocast; bf16-true: bf16 weights), as the
    synchronous path does: every logged value but timings, and the final weights, bit for bit at S = 0 (it used
    to sample in float32: other tokens by step 1)."""
    option = f"--trainer.precision={precision}"
    sync = fit(tmp_path / "sync", option, "--model.optimizer.init_args.lr=0.01")
    stale0 = fit(tmp_path / "async0", option, "--model.optimizer.init_args.lr=0.01", *asynchronous(0))
    assert untimed(stale0) == untimed(sync)
    assert same_weights(tmp_path / "sync", tmp_path / "async0")


@pytest.mark.slow
def test_staleness_0_samples_with_the_attention_the_trainer_s_first_update_chose(tmp_path, monkeypatch):
    """On an accelerator the first update switches the trainer's model to the packed path's attention (flash or flex:
    ``choose_attention``), and the synchronous rollout samples through that model from step 1 on. The producer's
    model kept SDPA, so S = 0 was not the synchronous run on a GPU (other sampler log-probs in fp32, other tokens in
    bf16); the push now carries the implementation. Eager stands in for the GPU's choice (none on a CPU), patched
    in the trainer's process only, as the GPU's choice is made there."""
    from sgrpo.model import packed_path

    monkeypatch.setattr(packed_path, "preferred_attention", lambda *args, **kwargs: "eager")
    sync = fit(tmp_path / "sync")
    stale0 = fit(tmp_path / "async0", *asynchronous(0))
    assert untimed(stale0) == untimed(sync)
    assert same_weights(tmp_path / "sync", tmp_path / "async0")


def test_a_push_copies_each_weight_as_it_comes_under_the_lock():
    """Each weight reaches the shared buffer before the next is gathered (under FSDP2 a gathered full tensor each, not
    the whole model, on the device at once), with the producer's lock held throughout."""
    producer, model = shipped_producer()
    try:
        pushed = [(name, value + 1) for name, value in plain_weights(model, buffers=False)]
        copied = []

        def stream():
            for i, (name, value) in enumerate(pushed):
                if i:
                    copied.append(torch.equal(producer._shared[pushed[i - 1][0]], pushed[i - 1][1]))
                assert not producer._lock.acquire(block=False)  # held by the push
                yield name, value

        producer.push(stream(), 1)
        assert len(copied) == len(pushed) - 1 > 10 and all(copied)
        assert all(torch.equal(producer._shared[name], value) for name, value in pushed)
    finally:
        producer.close()


def test_the_producer_s_buffer_takes_each_weight_as_it_comes_where_the_layout_is_known(monkeypatch):
    """At the producer's start the trainer's weights were all gathered before the shared buffer was laid out: under
    FSDP2 the whole model on the device at once, where a push holds one bucket (7B in float32: 28 GB). Laid out first
    from ``plain_layout`` (no gather: LoRA's merged weights under their base's names, dtypes and shapes), the buffer
    takes each weight before the next is gathered."""
    from transformers import AutoModelForCausalLM

    from sgrpo.model.lora import LoRA, apply_lora, plain_layout
    from sgrpo.rollout import shared_weights as module

    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    apply_lora(model, LoRA(rank=2))
    pairs = list(plain_weights(model, buffers=False))
    assert plain_layout(model) == [(name, value.dtype, tuple(value.shape)) for name, value in pairs]
    views, copied = {}, []
    real = module.weight_views
    monkeypatch.setattr(module, "weight_views", lambda flat, layout: views.update(real(flat, layout)) or views)

    def stream():
        for i, (name, value) in enumerate(pairs):
            if i:
                copied.append(torch.equal(views[pairs[i - 1][0]], pairs[i - 1][1]))
            yield name, value

    flat, layout = module.shared_weights(stream(), plain_layout(model))
    assert len(copied) == len(pairs) - 1 > 10 and all(copied)
    assert all(torch.equal(real(flat, layout)[name], value) for name, value in pairs)


def test_the_engine_sent_to_the_producer_carries_no_model_or_graphs():
    """An engine that already sampled (a validation before the fit, a second fit) holds the weights' shell and, with
    ``cuda_graphs``, graphs over the trainer's model and buffers: none of it is pickled into the producer's spec."""
    import pickle

    engine = HFRollout(max_new_tokens=4, weights_snapshot=True)
    engine._graphs = "graphs over the trainer's model"  # what a cuda_graphs rollout leaves
    engine._weights._shell = torch.nn.Linear(1000, 1000)  # the shell a snapshot rollout leaves
    copy = pickle.loads(pickle.dumps(engine))
    assert copy._graphs is None and copy._weights._shell is None
    assert (copy.max_new_tokens, copy.weights_snapshot) == (4, True) and engine._graphs is not None
    assert len(pickle.dumps(engine)) < 10_000  # the 4 MB of the shell's weights left behind


def test_under_fsdp2_bf16_mixed_the_producer_holds_each_weight_as_the_synchronous_rollout_s_copy(monkeypatch):
    """Under FSDP2 bf16-mixed the synchronous rollout decodes on ``RolloutWeights``' copy, whose blocks are bf16 as
    FSDP2 gathers them, norm weights included; the producer kept float32 weights under autocast (norms in float32:
    0.5 % of the argmaxes differed with perturbed norms), so S = 0 sampled another policy. The spec
    ``start_producer`` builds carries the gather dtype: the producer's model holds every parameter and buffer in the
    copy's dtype and, after a push, gives its logits bit for bit. Without a gather dtype (DDP) it stays float32."""
    from types import SimpleNamespace

    from sgrpo.model.loading import load_causal_lm
    from sgrpo.rollout.producer_process import sampling_model
    from sgrpo.rollout.snapshot import RolloutWeights
    from sgrpo.train import asynchronous

    model = load_causal_lm(SHIPPED, torch.float32)
    model.sgrpo_gather_dtype = torch.bfloat16  # what shard_model records under bf16-mixed
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norm weights of 1.0 are exact in bf16; trained ones are not
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    specs = []
    monkeypatch.setattr(asynchronous, "RolloutProducer", lambda spec, weights, timeout, shapes: specs.append(spec))
    policy = asynchronous.AsyncRollouts()
    vars(policy).update(seed=0, global_rank=0, _refill=None, rollout=HFRollout(max_new_tokens=4), max_staleness=0,
                        device=torch.device("cpu"), trainer=SimpleNamespace(precision="bf16-mixed"),
                        model_path=SHIPPED, model_dtype="float32", tokenizer=None, group_size=2,
                        producer_timeout=60, model=model)  # fmt: skip
    policy.start_producer(SimpleNamespace(batch=two_prompts), 0, 2)
    producer = sampling_model(specs[0])
    with torch.no_grad():  # a push, as the producer copies it in (newest_weights)
        pushed = dict(plain_weights(model, buffers=False))
        for name, param in producer.named_parameters(remove_duplicate=False):
            if name in pushed:
                param.copy_(pushed[name])
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 3, 4, 11]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), RolloutWeights(True)(model) as shell:
        dtypes = {name: t.dtype for name, t in [*shell.named_parameters(), *shell.named_buffers()]}
        assert {name: t.dtype for name, t in [*producer.named_parameters(), *producer.named_buffers()]} == dtypes
        assert dtypes["model.layers.0.input_layernorm.weight"] == torch.bfloat16
        assert torch.equal(producer(ids).logits, shell(ids).logits)
    del model.sgrpo_gather_dtype  # DDP: no gather dtype, nothing cast
    policy.start_producer(SimpleNamespace(batch=two_prompts), 0, 2)
    assert specs[1].gather_dtype is None
    assert {p.dtype for p in sampling_model(specs[1]).parameters()} == {torch.float32}


def test_a_producer_whose_fork_server_a_sigterm_ended_samples_on_and_close_ends_it():
    """A SIGTERM to the job's process group ends the fork server (it does not ignore SIGTERM; the producer does), and
    multiprocessing then read exit code 255 for a producer still sampling: a run of several processes failed with
    "ended with exit code 255" where it should have stopped at the step's end, and close() left the producer running."""
    from sgrpo.rollout.producer import exit_code

    producer, _ = shipped_producer()
    prompts = [ex.prompt for ex in two_prompts(0)]
    try:
        assert producer.take(0, prompts).step == 0
        pid = producer.process.pid
        with open(f"/proc/{pid}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(server) and running(pid)
        assert producer.process.exitcode == 255 and exit_code(producer.process) is None  # running, not ended
        assert producer.take(1, prompts).step == 1  # it samples on
    finally:
        producer.close()
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)
