"""FSDP2 through Lightning's ModelParallelStrategy on 2 CPU processes (gloo): equivalence, fit, resume, export."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from sgrpo.eval.report import read_run_metrics
from sgrpo.export import main as export
from sgrpo.fit import main
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.train.loss import AGGREGATIONS
from tests.ddp_grad_worker import TOKEN_METRICS
from tests.preloaded import run
from tests.server_ranks_job import check_server_ranks, prepare_server_ranks
from tests.sharded_async import async_jobs, check_async_rollouts_over_two_processes
from tests.sharded_ddp import check_ddp_jobs, ddp_jobs, single_process_gradients
from tests.sharded_lora import check_lora_fits_over_two_processes_resumes_and_exports_the_adapter, lora_jobs
from tests.sharded_worker import probe, update
from tests.test_eval_metrics import check_synced_metrics, check_two_sets_validate_as_one_process
from tests.test_policy_gradients import flat, rel_err

WORKER = Path(__file__).with_name("sharded_worker.py")
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SHARDED = Path(__file__).with_name("fixtures") / "sharded_cpu.yaml"
SHIPPED = TINY.parents[1] / "sgrpo" / "assets" / "quickstart_model"  # trained: its rewards vary
pytestmark = pytest.mark.slow  # every test here starts 2 processes
FUSED = "--model.optimizer.init_args.fused=true"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def launch(*args: str, cwd: Path, timeout: float = 300) -> tuple[str, str]:
    """Run the worker on 2 processes under torchrun, which starts both at once (they import in parallel: about 40 %
    less wall time than Lightning's launcher, which starts the second only once the first has imported and built
    its trainer; the launch a user's ``python -m sgrpo.fit`` makes is test_validate_launched_as_users_do's)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]  # a free port
    return run_processes([sys.executable, *torchrun, str(WORKER), *args], cwd=cwd, timeout=timeout)


def run_processes(command: list[str], cwd: Path, timeout: float = 300) -> tuple[str, str]:
    """Run ``command`` (which starts 2 processes) to its end and return its stdout and stderr; a hang fails the
    test and kills both, a non-zero exit fails it with the end of stderr."""
    with subprocess.Popen(
        command,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # one process group: the timeout kills Lightning's second process too
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            pytest.fail(f"the 2-process run hung for {timeout:.0f} s (collectives out of step?):\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return stdout, stderr


def chain(*jobs: list[str]) -> list[str]:
    """The worker's arguments for several jobs in one launch (see tests/sharded_worker.py)."""
    return [arg for i, job in enumerate(jobs) for arg in (["+"] if i else []) + job]


#: "uneven": two PPO epochs (old log-probs from a no-grad pass) with processes running different numbers of
#: micro-batches; "stale": rows sampled a step ago on some processes only, the decoupled objective's corrections
#: "rows", "groups": model.balance_batch moves rows or whole groups between the processes (float rounding only)
SCENARIOS = ("plain", "uneven", "kl_bf16", "stale", "rows", "groups")


def test_fsdp2_update_rollouts_fit_resume_export_and_validate(model_dir, tmp_path, capsys):
    """Jobs in one 2-process launch (one interpreter start per process instead of one per job; each job builds
    its own trainers and model): a sharded update in three scenarios, rollouts from the sharded model, the
    evaluation metrics synced over the processes and a validation of two evaluation sets
    (tests/test_eval_metrics.py), a DDP update per loss aggregation, the same with ``model.balance_batch`` (rows,
    groups) per global aggregation, a balanced update whose process 1 raises in the exchange, a DDP step non-finite
    on one process, a
    3-step fit, its resume to step 5 from the sharded checkpoint, a resume of it as another experiment
    (refused), ``sgrpo.fit validate`` of that checkpoint, a bf16 fit with a KL, LoRA fits and resumes under FSDP2
    and DDP, and a fit whose rows end at different lengths on each process. Each is checked below by its own
    function. Last, VLLMServerRollout's rank-0 failures raised at once on rank 1 (tests/server_ranks_job.py)."""
    root, out, bf16 = tmp_path / "run", tmp_path / "out", tmp_path / "bf16"
    checkpoint = root / "checkpoints" / "last.ckpt"
    for scenario in SCENARIOS:
        update(model_dir, str(out / f"single_{scenario}"), "single", scenario)
    server_job, server = prepare_server_ranks(tmp_path / "server_ranks")
    _, stderr = launch(
        *chain(
            *(["update", model_dir, str(out / f"sharded_{s}"), "sharded", s] for s in SCENARIOS),
            ["decode", model_dir, str(out / "decode")],
            ["metrics", str(out / "metrics")],
            ["validate_sets", str(out / "sets")],
            *ddp_jobs(model_dir, out),
            # fused AdamW on DTensors, as the GPU recipes; at step 3 last.ckpt is a tree of hard links to step3.ckpt
            ["fit", str(root), model_dir, "3", "", FUSED, "--checkpoint_every=3"],
            ["fit", str(root), model_dir, "5", "last", FUSED],
            ["refused_resume", str(tmp_path / "refused"), model_dir, str(checkpoint)],
            ["validate", str(root), model_dir, str(checkpoint)],
            ["fit", str(tmp_path / "disagree" / "run"), model_dir, "2", "", "--trainer.strategy=ddp",
             "--checkpoint_every=1"],
            ["disagreeing_resume", str(tmp_path / "disagree"), model_dir],
            ["fit", str(bf16), str(SHIPPED), "2", "", *BF16_KL_FSDP],  # rewards vary: the update moves it
            *lora_jobs(tmp_path),
            ["fit_recording_lengths", str(tmp_path / "lengths"), "4"],
            *async_jobs(tmp_path / "async", FUSED),
            server_job,
        ),
        cwd=tmp_path,
        timeout=600,  # 93 s measured with the machine at load average 10-12, before the async jobs (+1-3 min)
    )
    server.stop()
    assert "model.packing: falling back" not in stderr  # packed log-probs (the default) pass their check sharded
    assert "model.share_prompts: packed rows hold" not in stderr  # and so does each group's prompt once
    for scenario in SCENARIOS:
        check_sharded_update_equals_single_process_update(model_dir, out, scenario)
    check_sharded_rollouts_sample_the_unsharded_policy(out / "decode")
    check_synced_metrics(out / "metrics")
    check_two_sets_validate_as_one_process(out / "sets", tmp_path)
    single = single_process_gradients(model_dir)
    check_two_ddp_processes_give_the_single_process_gradient(single, out / "ddp")
    check_ddp_jobs(single, out)  # tests/sharded_ddp.py
    check_sharded_fit_resumed_and_exports(root, checkpoint, tmp_path / "exported")
    check_a_resume_as_another_experiment_is_refused_in_one_line(tmp_path / "refused")
    check_processes_that_see_another_checkpoint_refuse_the_resume(tmp_path / "disagree")
    check_sharded_checkpoint_validates_with_its_strategy_only(model_dir, root, checkpoint, capsys)
    check_fsdp_fits_as_fsdp2_under_bf16_with_a_kl(bf16, stderr)
    check_lora_fits_over_two_processes_resumes_and_exports_the_adapter(tmp_path)
    check_async_rollouts_over_two_processes(tmp_path / "async")
    check_rows_ending_at_different_lengths_per_process_decode_as_many_forwards(tmp_path / "lengths")
    check_server_ranks(tmp_path / "server_ranks")


#: rel. tolerance of the sharded update against the single-process one: float noise in fp32; under bf16-mixed each
#: micro-batch's weight gradients are rounded to bf16, and 1 and 2 processes cut different micro-batches
#: (measured: loss 3.5e-5, gradient norm 8e-5, KL 7e-3); with each group's prompt once (packed, the default) a
#: micro-batch holding two rows of a group runs them under a block mask, whose bf16 roundings differ from the
#: unshared layout's (per token up to 6e-4, as far from a float32 run as the unshared; measured loss 2.8e-4)
TOLERANCE = {"plain": 1e-5, "uneven": 1e-5, "kl_bf16": 1e-3, "stale": 1e-5, "rows": 1e-6, "groups": 1e-6}


def check_sharded_update_equals_single_process_update(model_dir: str, out: Path, scenario: str) -> None:
    """One update sharded over 2 processes equals the single-process one, each process holding about half of
    the parameters. FSDP2 reduce-scatters once per optimiser step (the gradients of its micro-batches accumulate
    unsharded). Under bf16-mixed its blocks compute on bf16 weights gathered from float32 shards, and the KL
    reference is bf16 where the policy's forward is, and sharded too."""
    one = json.loads((out / f"single_{scenario}" / "info.json").read_text())
    two = json.loads((out / f"sharded_{scenario}" / "info.json").read_text())
    tolerance = TOLERANCE[scenario]
    assert two["loss"] == pytest.approx(one["loss"], rel=tolerance), scenario
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=tolerance), scenario
    assert two["optimizer_steps"] == one["optimizer_steps"]
    offpolicy = {k: v for k, v in one.items() if k.startswith("train/offpolicy/")}
    assert bool(offpolicy) == (scenario == "stale") and offpolicy.keys() == {
        k for k in two if k.startswith("train/offpolicy/")}, scenario  # fmt: skip
    for key, value in offpolicy.items():  # sums over both processes' tokens, then the ratio: as one process
        assert two[key] == pytest.approx(value, rel=tolerance, abs=1e-7), (scenario, key)
    if offpolicy:  # the corrections bit: some tokens masked, some truncated, unequal weights
        assert 0 < offpolicy["train/offpolicy/masked_fraction"] < 0.5 and offpolicy["train/offpolicy/ess"] < 1
        assert offpolicy["train/offpolicy/truncated_fraction"] > 0 and offpolicy["train/offpolicy/k3"] > 0
    assert two["reduce_scatters_per_group"] == two["optimizer_steps"] < two["backwards"] or scenario == "plain"
    bf16 = scenario == "kl_bf16"
    assert two["forward_dtypes"] == ["torch.bfloat16" if bf16 else "torch.float32"]  # a block's gathered weight
    assert two["sharded_dtypes"] == ["torch.float32"]  # master weights (and so the optimiser state)
    if bf16:
        assert one["kl"] > 0 and two["kl"] == pytest.approx(one["kl"], rel=2e-2)
        assert all(two["reference_dtensors"]) and abs(two["reference_local_share"] - 0.5) < 0.02
        assert two["reference_dtypes"] == ["torch.bfloat16", "torch.float32"]  # blocks; embeddings, final norm
    assert sum(two["local_params"]) == one["local_params"][0]
    assert all(abs(n / one["local_params"][0] - 0.5) < 0.02 for n in two["local_params"])
    a = torch.load(out / f"single_{scenario}" / "params.pt")
    b = torch.load(out / f"sharded_{scenario}" / "params.pt")
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], initial[name]) or "norm" in name  # the update moved the weights
        if bf16:  # bf16 gradients: within 1 % of each weight's update (measured up to 0.3 %; fp32: 1e-7 of it)
            assert (a[name] - b[name]).norm() <= 1e-2 * (a[name] - initial[name]).norm(), (scenario, name)
        else:
            assert (a[name] - b[name]).norm() <= 1e-5 * a[name].norm(), (scenario, name)


#: Lightning's FSDP name (run as FSDP2), bf16-mixed (blocks gathered in bf16) and a KL to a sharded bf16 reference
BF16_KL_FSDP = ["--trainer.strategy=fsdp", "--trainer.precision=bf16-mixed", "--model.loss.init_args.kl_coef=0.001"]


def check_fsdp_fits_as_fsdp2_under_bf16_with_a_kl(root: Path, stderr: str) -> None:
    """``--trainer.strategy=fsdp`` trains as FSDP2, saying so once (on the first process), here under bf16-mixed
    with a KL: the rollout's weight snapshot is cast as the blocks are gathered, so the sampler's log-probs stay
    the trainer's within test_fit's bf16-mixed bound; the checkpoint is FSDP2's (one shard per process)."""
    assert stderr.count("note: trainer.strategy fsdp runs as FSDP2") == 1
    rows = []
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with open(path) as f:
            rows += [r for r in csv.DictReader(f) if r.get("train/reward")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    for row in rows:
        assert float(row["train/rollout/mismatch_max_abs"]) < 0.1
        assert float(row["train/rollout/mismatch_abs_diff"]) < 5e-3
        assert 0 <= float(row["train/kl"]) < 0.1
    assert float(rows[0]["train/kl"]) == 0 < float(rows[1]["train/kl"])  # the reference is the policy at load
    assert len(list((root / "checkpoints" / "last.ckpt").glob("*.distcp"))) == 2


def check_sharded_rollouts_sample_the_unsharded_policy(out: Path) -> None:
    """Rollouts from the FSDP2-sharded model, on weights gathered once per rollout (the default) or through
    the sharded forwards token by token, give the unsharded model's tokens and log-probs, each process
    sampling its own prompts."""
    for rank in (0, 1):
        runs = json.loads((out / f"decode_rank{rank}.json").read_text())
        for name in ("gathered", "per_token"):
            assert runs[name]["ids"] == runs["plain"]["ids"], (rank, name)
            got, want = torch.tensor(runs[name]["logprobs"]), torch.tensor(runs["plain"]["logprobs"])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert runs["gathered"]["sharded_forwards"] == 0  # no collective per token: one gather per rollout
        assert runs["per_token"]["sharded_forwards"] >= 6  # the prefill and a forward per new token
        # the vLLM sync's gather: every parameter cast to bf16 before it travels, one collective for all (before:
        # one per parameter, in float32), the padded rows of uneven shards cut away
        gather = runs["gather"]
        assert gather["equal"] and gather["dtypes"] == ["torch.bfloat16"] and gather["uneven"], gather
        assert gather["sizes"] == [gather["padded_bytes"]], gather
        assert gather["mixed"], "a bucket of bf16 and float32 sections (LoRA under FSDP2) gathered wrong"
        episodes = runs["episodes"]  # multi-turn: the processes' turn counts differ, and no collective per turn
        assert episodes["gathered"]["ids"] == episodes["plain"]["ids"], rank
        assert episodes["gathered"]["turns"] == episodes["plain"]["turns"] and max(episodes["plain"]["turns"]) > 1
        got, want = torch.tensor(episodes["gathered"]["logprobs"]), torch.tensor(episodes["plain"]["logprobs"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert episodes["per_token"].startswith("multi-turn episodes under FSDP2 need rollout.weights_snapshot")
    turns = [json.loads((out / f"decode_rank{r}.json").read_text())["episodes"]["plain"]["turns"] for r in (0, 1)]
    assert sum(turns[0]) != sum(turns[1])  # the processes ran different numbers of turns


def check_two_ddp_processes_give_the_single_process_gradient(single: dict[str, torch.Tensor], out: Path) -> None:
    """2 DDP processes, each running several micro-batches (tests/ddp_grad_worker.py), give the single-process
    gradient with a single all-reduce (DDP's no_sync on all but the last backward), for every aggregation, and
    logs its entropy (a mean over every process's loss tokens; their counts differ) and skipped rows (a sum) as one
    process does (before: each process's mean, averaged over processes, 3e-4 off; the count halved)."""
    for aggregation in AGGREGATIONS:
        info = json.loads((out / f"grads_{aggregation}.json").read_text())
        assert info["world_size"] == 2 and info["rows_per_rank"] == [8, 8], aggregation
        assert rel_err(flat(torch.load(out / f"grads_{aggregation}.pt")), single[aggregation]) < 1e-6, aggregation
        for key in TOKEN_METRICS:
            assert info[key] == pytest.approx(float(single[f"{aggregation}/{key}"]), rel=1e-6), (aggregation, key)
        # micro-batches of 2 rows: several backwards per process, but one gradient all-reduce per optimiser step
        assert info["allreduce_rounds_per_rank"] == [1, 1], aggregation


def check_sharded_fit_resumed_and_exports(root: Path, checkpoint: Path, exported: Path) -> None:
    """A 3-step FSDP2 fit wrote one checkpoint shard per process (``step3.ckpt`` once, ``last.ckpt`` a tree of hard
    links to it, replaced by the resume's own at step 5); the resume picked up at step 3; the run's
    export and ``python -m sgrpo.export`` of the sharded checkpoint (gathered in this one process) both hold
    the trained policy, the tied LM head written once (the gathered state dict held a copy under each name)."""
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 2  # one shard per process
    steps = []
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with open(path) as f:
            steps.append([int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")])
    assert steps == [[0, 1, 2], [3, 4]]  # the resumed run picks up at step 3 (from last.ckpt, linked to step3.ckpt)
    linked = root / "checkpoints" / "step3.ckpt"
    assert len(list(linked.glob("*.distcp"))) == 2  # kept (keep_last 3) whole, once last.ckpt was replaced
    assert list(root.glob("evaluations/version_0/metrics.csv"))  # validate logs beside the run
    records = [line for line in (root / "metrics.jsonl").read_text().splitlines() if "train/reward" in line]
    assert len(records) == 5 and [s for s, _ in read_run_metrics(root)["train/reward"]] == [0, 1, 2, 3, 4]  # rank 0's
    export([str(checkpoint), str(exported)])
    for folder in (root / "hf_model", exported):
        model = AutoModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(probe(model), torch.load(root / "probe_logprobs.pt"), atol=1e-6, rtol=1e-5)
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        saved = {key for file in folder.glob("*.safetensors") for key in safe_open(file, "pt").keys()}  # noqa: SIM118
        assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # tied: written once


def check_a_resume_as_another_experiment_is_refused_in_one_line(root: Path) -> None:
    """A resume with another estimator temperature is refused on every process (``ResumeError``) as on one: the
    one-line error and exit 2, and the processes carry on (the launch's next jobs ran). Process 0 came a second
    late: with the refusal taken for one process's error (``fail_fast``), process 1 ended the job first, in
    ``os._exit(2)``, and process 0 was ended by its abort watch with exit 1."""
    for rank in (0, 1):
        refused = json.loads((root / f"refused.{rank}.json").read_text())
        errors = [line for line in refused["stderr"].splitlines() if line.startswith("error: ")]
        assert refused["code"] == 2 and len(errors) == 1, refused
        assert "(ResumeError: it was trained as another experiment (" in errors[0], refused
        assert "model.estimator.init_args.temperature: 0.5 -> 0.7" in errors[0] and "Traceback" not in refused["stderr"]


def check_processes_that_see_another_checkpoint_refuse_the_resume(root: Path) -> None:
    """``--ckpt_path last`` under DDP, process 1 seeing another run folder at the same path (``step1.ckpt`` its
    newest): each process resolved "last" alone (and hashed the whole file), and Lightning's DDP strategy does not
    broadcast the path, so process 1 resumed step 1 against process 0's step 2, silently. Now process 0 alone
    resolves it, broadcasts its choice, every process compares what it sees there, and both refuse in one line."""
    for rank in (0, 1):
        seen = json.loads((root / f"disagree.{rank}.json").read_text())
        errors = [line for line in seen["stderr"].splitlines() if line.startswith("error: ")]
        assert seen["code"] == 2 and len(errors) == 1 and "Traceback" not in seen["stderr"], seen
        assert errors[0].startswith(f"error: --ckpt_path {Path('run') / 'checkpoints' / 'last.ckpt'}: process 1 sees "
                                    "other bytes there than process 0"), errors  # fmt: skip
    assert torch.load(root / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2  # untouched


def check_sharded_checkpoint_validates_with_its_strategy_only(model_dir: str, root: Path, checkpoint: Path, capsys):
    """One process cannot read a sharded checkpoint (export it, or use the run's strategy); under that strategy
    (the launch's last job) ``sgrpo.fit validate`` evaluates it."""
    with pytest.raises(SystemExit) as refused:
        main(["validate", "--config", str(TINY), f"--model.model={model_dir}", f"--trainer.default_root_dir={root}",
              f"--ckpt_path={checkpoint}"])  # fmt: skip
    assert refused.value.code == 2 and "is sharded: evaluate it with the strategy" in capsys.readouterr().err
    result = json.loads((root / "validation.json").read_text())
    assert result["step"] == 5 and result["prompts"] == 16 and set(result["by_difficulty"]) == {"3", "5"}


def check_rows_ending_at_different_lengths_per_process_decode_as_many_forwards(root: Path) -> None:
    """The default lean decoder under FSDP2 with the shipped (trained) model, whose rows end early and at
    different lengths on each process: every process must run as many forwards (each all-gathers), or the
    run hangs (it did: rank 1 left its decode loop after 7 forwards while rank 0 waited in its 8th), whether
    the loop reads its running rows at every token or every 3 (rollouts alternate). With dynamic sampling,
    every process must also run as many refill rounds. (A job of the joined launch: a hang there fails the
    launch at its timeout.)"""
    lengths = [json.loads((root / f"lengths_rank{r}.json").read_text()) for r in (0, 1)]
    # the longest completion of each rollout, per process: as many rollouts on both (dynamic sampling's
    # refill rounds included), at least one per step
    assert len(lengths[0]) == len(lengths[1]) >= 4
    # some step's rows all finished on one process before max_new_tokens (8) while the other's ran on
    assert any(a != b and min(a, b) < 8 for a, b in zip(*lengths)), lengths
    assert (root / "hf_model" / "config.json").exists()


def test_validate_launched_as_users_do_counts_each_prompt_once_as_one_process_does(tmp_path, capsys):
    """``python -m sgrpo.fit validate`` over 2 FSDP2 processes started by Lightning's launcher, 15 prompts in
    batches of 4: the second process must validate too (it re-ran sys.argv without the mode, trained, and the
    run hung), and the prompt the sampler repeats to even out the processes (16 = 2 x 8) counts once. Greedy,
    so the printed table is the one-process table."""
    args = ["validate", "--config", str(TINY), "--model.task.init_args.num_validation=15",
            "--trainer.limit_val_batches=null", "--model.val_prompts_per_batch=4", "--model.val_greedy=true",
            "--model.val_samples=1", "--trainer.enable_progress_bar=false"]  # fmt: skip
    sharded = ["--config", str(SHARDED), f"--trainer.default_root_dir={tmp_path}/2"]
    # process 0 forked from the worker's preloaded interpreter (tests/preloaded.py); Lightning starts process 1
    done = run([sys.executable, "-m", "sgrpo.fit", *args, *sharded], cwd=TINY.parents[1],
               env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    two, log = done.stdout, done.stderr
    # nor does Lightning's advice to sync the metrics or not to use its sampler apply: they are gathered, and
    # each prompt counts once
    assert "It is recommended to use `self.log(" not in log and "Using `DistributedSampler`" not in log
    main([*args, f"--trainer.default_root_dir={tmp_path}/1"])
    one = capsys.readouterr().out
    table = one[one.index("Validation accuracy by difficulty") :]
    assert "(15 prompts, 1 sample each)" in table
    assert two[two.index("Validation accuracy by difficulty") :] == table
