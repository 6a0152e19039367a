"""Run by test_sharded.py on 2 processes: under torchrun (both started at once), or with Lightning's launcher
(run once, Lightning starts the second process itself).

sharded_worker.py update MODEL_DIR OUT_DIR [STRATEGY [SCENARIO]]   one update of the fixed batch, results to OUT_DIR
sharded_worker.py fit ROOT MODEL_DIR STEPS [last [ARGS...]]   fit configs/tiny.yaml sharded over 2 processes
sharded_worker.py fit_recording_lengths ROOT STEPS   the same with the shipped model, recording completion lengths
sharded_worker.py validate ROOT MODEL_DIR CHECKPOINT   sgrpo.fit validate of a sharded checkpoint over 2 processes
sharded_worker.py refused_resume ROOT MODEL_DIR CHECKPOINT   resume CHECKPOINT as another experiment (process 0
                                                  a second late, so process 1 refuses first); each process's exit
                                                  status and stderr to ROOT/refused.RANK.json
sharded_worker.py disagreeing_resume ROOT MODEL_DIR   resume the DDP run ROOT/run where process 1 sees another
                                                  folder; each process's exit status and stderr to
                                                  ROOT/disagree.RANK.json
sharded_worker.py decode MODEL_DIR OUT   rollouts from the sharded model (tests/sharded_rollout_jobs.py)
sharded_worker.py metrics OUT   the evaluation's torchmetrics metrics synced over the 2 processes
sharded_worker.py validate_sets ROOT   sgrpo.fit validate of a task with two evaluation sets over 2 processes
sharded_worker.py ddp_grads MODEL_DIR OUT AGGREGATION...   one DDP update per aggregation (tests/sharded_ddp.py, as
                                                  the next three; tests/ddp_grad_worker.py)
sharded_worker.py ddp_balanced MODEL_DIR OUT AGGREGATION...   the same with model.balance_batch rows and groups
sharded_worker.py balance_failure MODEL_DIR OUT   a balanced DDP update whose process 1 raises in the exchange
sharded_worker.py nonfinite MODEL_DIR OUT   2 DDP steps, the first one's gradient NaN on process 1 only
sharded_worker.py server_ranks PYTHON URL OUT   VLLMServerRollout's rank-0 failures, learnt by rank 1
                                                  (tests/server_ranks_job.py)
sharded_worker.py async_fit ROOT MODEL_DIR STEPS SKEW [ARGS...]   fit with async rollouts; SKEW "slow": the producers
                                                  sleep 0.5 s a step, "fast": the trainers 0.4 s an update, "": none
sharded_worker.py async_estimators OUT MODEL_DIR STEPS VARIANT...   per estimator (VARIANT "GRPO", "RLOO+dynamic":
                                                  with dynamic sampling), a DDP fit and its staleness-0 async twin

Several jobs run one after another in the same 2 processes when joined by ``+`` (``update A B + decode C D``):
each job builds its own trainer, model and optimiser, and they share the process group. One launch instead of one
per job spares the tests an interpreter start and the torch/Lightning/transformers imports (about 4 s of CPU
per process) for each job.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from estimators import GRPO  # noqa: E402
from sgrpo.distributed import release_process_group  # noqa: E402
from sgrpo.model.logprobs import completion_logprobs  # noqa: E402
from tests.engine_helpers import EXAMPLES, fixed_batch, run_steps  # noqa: E402
from tests.test_policy_gradients import MAX_NEW, G, make_policy  # noqa: E402

SHARDED_CPU = REPO / "tests" / "fixtures" / "sharded_cpu.yaml"
PROBE = torch.tensor([[16, 15, 6, 4, 7, 14, 5, 6, 7, 2]])  # "s:314=" then a 4-token completion


def full_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


#: a second scenario: old log-probs from a no-grad pass (two PPO epochs), and processes with different
#: numbers of micro-batches (dynamic sampling drops the constant group on rank 0 only)
UNEVEN = {"ppo_epochs": 2, "dynamic_sampling": True, "max_sampling_rounds": 1, "micro_batch_size": 2}
#: a third: bf16-mixed (FSDP2 gathers the blocks in bf16 and reduces in fp32) with a KL to a (sharded) reference,
#: two PPO epochs (the second one away from the reference), several micro-batches per optimiser step
KL_BF16 = {"ppo_epochs": 2, "micro_batch_size": 2}
#: a fourth: stale rows on some processes only (tests/test_offpolicy_update.py's HalfStaleRollout), corrected
STALE = {"micro_batch_size": 2}
#: fifth and sixth: model.balance_batch moves rows ("rows") or whole groups ("groups") between the processes
SCENARIOS = {
    "plain": ({}, "32-true"), "uneven": (UNEVEN, "32-true"), "kl_bf16": (KL_BF16, "bf16-mixed"),
    "stale": (STALE, "32-true"), "rows": ({"balance_batch": "rows", "micro_batch_size": 2}, "32-true"),
    "groups": ({"balance_batch": "groups", "micro_batch_tokens": 16}, "32-true"),
}  # fmt: skip


def update(model_dir: str, out: str, strategy: str = "sharded", scenario: str = "plain") -> None:
    from sgrpo.train.loss import ClippedSurrogate

    batch = fixed_batch(model_dir, EXAMPLES[:4], group_size=G, max_new_tokens=MAX_NEW)
    extra, precision = SCENARIOS[scenario]
    if scenario == "kl_bf16":
        extra = extra | {"loss": ClippedSurrogate(kl_coef=0.001)}
    if scenario == "stale":
        from tests.test_offpolicy_update import half_stale_loss

        extra = extra | {"loss": half_stale_loss()}
    policy = make_policy(model_dir, batch, GRPO(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5), **extra)
    if scenario == "stale":
        from tests.test_offpolicy_update import HalfStaleRollout

        policy.rollout = HalfStaleRollout(batch)
    probes = record_sharding(policy) if strategy == "sharded" else {}
    if strategy == "sharded":
        trainer = run_steps(
            policy, devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            precision=precision,
        )  # fmt: skip
        local = sum(p.to_local().numel() for p in policy.model.parameters())
        counts = [torch.zeros(1) for _ in range(2)]
        torch.distributed.all_gather(counts, torch.tensor([float(local)]))
        state = full_state(policy.model)
    else:
        trainer = run_steps(policy, precision=precision)
        counts = [torch.tensor([float(sum(p.numel() for p in policy.model.parameters()))])]
        state = policy.model.state_dict()
    if trainer.is_global_zero:
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(out) / "params.pt")
        info = {
            "loss": float(trainer.callback_metrics["train/loss"]),
            "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
            "kl": float(trainer.callback_metrics.get("train/kl", 0.0)),
            "local_params": [int(c.item()) for c in counts],
            "total_params": sum(v.numel() for k, v in state.items()),
            "optimizer_steps": len(policy.captured),
        }
        info |= {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/offpolicy/")}
        info |= {name: probe() for name, probe in probes.items()}
        (Path(out) / "info.json").write_text(json.dumps(info))


def record_sharding(policy) -> dict:
    """Probes of a sharded update, read after it: the dtype of a block's weight during its forwards, of the
    sharded parameters, of the reference's (sharded?) parameters, and the reduce-scatters the backwards ran."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    seen: dict[str, list] = {"forward_dtypes": [], "reduce_scatters": [], "backwards": []}
    reduce_scatter = torch.distributed.reduce_scatter_single

    def counting(*args, **kwargs):
        seen["reduce_scatters"].append(1)
        return reduce_scatter(*args, **kwargs)

    torch.distributed.reduce_scatter_single = counting
    configure, backward = policy.configure_model, policy._backward

    def configure_model() -> None:
        configure()
        layer = policy.model.model.layers[0].self_attn.q_proj
        layer.register_forward_pre_hook(lambda m, _: seen["forward_dtypes"].append(str(m.weight.dtype)))

    def counted_backward(*args, **kwargs):
        seen["backwards"].append(1)
        return backward(*args, **kwargs)

    policy.configure_model, policy._backward = configure_model, counted_backward
    reference = lambda: [] if policy._reference is None else list(policy._reference.parameters())  # noqa: E731
    groups = lambda: sum(isinstance(m, FSDPModule) for m in policy.model.modules())  # noqa: E731
    return {
        "forward_dtypes": lambda: sorted(set(seen["forward_dtypes"])),
        "sharded_dtypes": lambda: sorted({str(p.dtype) for p in policy.model.parameters()}),
        "reduce_scatters_per_group": lambda: len(seen["reduce_scatters"]) / groups(),
        "backwards": lambda: len(seen["backwards"]),
        "reference_dtensors": lambda: [isinstance(p, DTensor) for p in reference()],
        "reference_local_share": lambda: sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in reference()
        ) / max(1, sum(p.numel() for p in reference())),
        "reference_dtypes": lambda: sorted({str(p.dtype) for p in reference()}),
    }


def fit(root: str, model_dir: str, steps: str, resume: str = "", *extra: str) -> None:
    from sgrpo.fit import main

    args = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "--config",
        str(REPO / "tests/fixtures/sharded_cpu.yaml"),
        f"--model.model={model_dir}",
        f"--trainer.default_root_dir={root}",
        f"--trainer.max_steps={steps}",
        "--trainer.val_check_interval=100",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    cli = main(args + (["--ckpt_path=last"] if resume else []))
    logp = probe(cli.model.model)
    if cli.trainer.is_global_zero:
        torch.save(logp, Path(root) / "probe_logprobs.pt")


def probe(model) -> torch.Tensor:
    """The model's log-probs of ``PROBE``'s 4-token completion, ``[1, 4]`` (what the tests compare runs by)."""
    with torch.no_grad():
        return completion_logprobs(model, PROBE, torch.ones_like(PROBE), torch.ones(1, 4, dtype=torch.bool))[0]


def async_fit(root: str, model_dir: str, steps: str, skew: str, *extra: str) -> None:
    from sgrpo.rollout.producer import DELAY_ENV
    from sgrpo.train.update import PolicyUpdate

    update = PolicyUpdate.update
    if skew == "slow":
        os.environ[DELAY_ENV] = "0.5"
    elif skew == "fast":
        PolicyUpdate.update = lambda self, *args, **kwargs: (time.sleep(0.4), update(self, *args, **kwargs))[1]
    try:
        fit(root, model_dir, steps, "", "--model.async_rollout=true", *extra)
    finally:
        os.environ.pop(DELAY_ENV, None)
        PolicyUpdate.update = update


def async_estimators(out: str, model_dir: str, steps: str, *variants: str) -> None:
    """For each variant ("GRPO", or "RLOO+dynamic": that estimator with dynamic sampling), a synchronous
    DDP fit and its staleness-0 async twin, to OUT/VARIANT/sync and OUT/VARIANT/s0."""
    for variant in variants:
        estimator, *dynamic = variant.split("+")
        extra = ["--trainer.strategy=ddp", f"--model.estimator=estimators.{estimator}"]
        extra += ["--model.dynamic_sampling=true", "--model.max_sampling_rounds=3"] if dynamic else []
        fit(str(Path(out) / variant / "sync"), model_dir, steps, "", *extra)
        async_fit(str(Path(out) / variant / "s0"), model_dir, steps, "", *extra, "--model.max_staleness=0")


def validate(root: str, model_dir: str, checkpoint: str) -> None:
    """``sgrpo.fit validate`` of a sharded checkpoint under the strategy that wrote it; the result to
    ``ROOT/validation.json``."""
    from sgrpo.fit import main

    cli = main(["validate", "--config", str(REPO / "configs" / "tiny.yaml"), "--config",
                str(REPO / "tests/fixtures/sharded_cpu.yaml"), f"--model.model={model_dir}",
                f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
                f"--ckpt_path={checkpoint}"])  # fmt: skip
    if cli.trainer.is_global_zero:
        (Path(root) / "validation.json").write_text(json.dumps(cli.model.last_evaluation))


def validate_sets(root: str) -> None:
    """``sgrpo.fit validate`` of a task with two evaluation sets (tests/test_eval_metrics.py ``TWO_SETS``) over
    the 2 processes; the result to ``ROOT/validation.json``."""
    from sgrpo.fit import main
    from tests.test_eval_metrics import TWO_SETS

    sharded = ["--config", str(REPO / "tests/fixtures/sharded_cpu.yaml"), f"--trainer.default_root_dir={root}"]
    cli = main([*TWO_SETS, *sharded])
    if cli.trainer.is_global_zero:
        (Path(root) / "validation.json").write_text(json.dumps(cli.model.last_evaluation))


def refused_resume(root: str, model_dir: str, checkpoint: str) -> None:
    """A resume with another SoftmaxGRPO temperature: every process refuses it (``ResumeError``) at the same point;
    process 0 comes a second late, so a process 1 that ended the job (``fail_fast``) would end it first."""
    import contextlib
    import io
    import os
    import time

    from sgrpo.fit import main
    from sgrpo.run.saving import RunCheckpoint

    rank, load = int(os.environ.get("RANK", "0")), RunCheckpoint.on_load_checkpoint

    def late(self, trainer, pl_module, checkpoint):  # where the refusal is made
        time.sleep(1.5 if rank == 0 else 0.0)  # past the abort watch's period (0.5 s)
        load(self, trainer, pl_module, checkpoint)

    RunCheckpoint.on_load_checkpoint, stderr, code = late, io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(stderr):
            main(["--config", str(REPO / "configs" / "tiny.yaml"), "--config", str(SHARDED_CPU),
                  f"--model.model={model_dir}", f"--trainer.default_root_dir={root}", "--trainer.max_steps=6",
                  "--trainer.enable_progress_bar=false", "--model.estimator.init_args.temperature=0.7",
                  f"--ckpt_path={checkpoint}"])  # fmt: skip
    except SystemExit as err:
        code = err.code
    finally:
        RunCheckpoint.on_load_checkpoint = load
    Path(root).mkdir(parents=True, exist_ok=True)
    (Path(root) / f"refused.{rank}.json").write_text(json.dumps({"code": code, "stderr": stderr.getvalue()}))


def disagreeing_resume(root: str, model_dir: str) -> None:
    """``--ckpt_path last`` of the DDP run ``ROOT/run``, given as the relative path ``run`` (as a cluster gives the same
    path to every process), where process 1 sees another folder: a copy lacking ``last.ckpt`` and ``step2.ckpt`` (a
    stale network-filesystem view), so that resolving it alone it took ``step1.ckpt``. Each process's exit status and
    stderr to ROOT/disagree.RANK.json."""
    import contextlib
    import io
    import os
    import shutil

    from sgrpo.fit import main

    rank, here = int(os.environ.get("RANK", "0")), os.getcwd()
    view = Path(root) if rank == 0 else Path(root) / "stale"
    if rank == 1:
        # process 0 may still be writing the previous job's export (rank 0 alone, after the fit): not copied
        ignore = shutil.ignore_patterns(".sgrpo.lock", "hf_model", ".hf_model.*")
        shutil.copytree(Path(root) / "run", view / "run", ignore=ignore)
        for name in ("last.ckpt", "step2.ckpt"):
            (view / "run" / "checkpoints" / name).unlink()
    stderr, code = io.StringIO(), 0
    os.chdir(view)
    try:
        with contextlib.redirect_stderr(stderr):
            main(["--config", str(REPO / "configs" / "tiny.yaml"), "--config", str(SHARDED_CPU),
                  f"--model.model={model_dir}", "--trainer.default_root_dir=run", "--trainer.max_steps=3",
                  "--trainer.strategy=ddp", "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=100",
                  "--checkpoint_every=1", "--ckpt_path=last"])  # fmt: skip
    except SystemExit as err:
        code = err.code
    finally:
        os.chdir(here)
    (Path(root) / f"disagree.{rank}.json").write_text(json.dumps({"code": code, "stderr": stderr.getvalue()}))


def fit_recording_lengths(root: str, steps: str) -> None:
    """``fit`` with the shipped quickstart model, whose rows end at different lengths on each process, decoding
    through the sharded forwards;
    each process writes the longest completion of each of its rollouts to ``ROOT/lengths_rank<r>.json``."""
    from sgrpo.rollout import HFRollout

    lengths: list[int] = []
    generate = HFRollout.generate

    def recording(self, *args, **kwargs):
        batch = generate(self, *args, **kwargs)
        lengths.append(int(batch.completion_mask.sum(-1).max()))
        return batch

    HFRollout.generate = recording
    # rollouts alternate between reading the running rows at every token and every 3 tokens (an accelerator's
    # default reads every 8): the processes must agree on when their loops end either way
    import sgrpo.rollout.decode

    interval = sgrpo.rollout.decode.check_interval
    sgrpo.rollout.decode.check_interval = lambda device: 3 if len(lengths) % 2 else 1
    # decode through the sharded model token by token (no weights snapshot): the path whose loop must end
    # at the same step on every process
    no_snapshot = "--model.rollout.init_args.weights_snapshot=false"
    # with dynamic sampling each process needs its own number of refill rounds: they must run as many
    try:
        fit(root, str(REPO / "sgrpo/assets/quickstart_model"), steps, "", no_snapshot, "--model.dynamic_sampling=true")
    finally:  # the launch's next jobs decode as usual
        HFRollout.generate, sgrpo.rollout.decode.check_interval = generate, interval
    rank = torch.distributed.get_rank()
    (Path(root) / f"lengths_rank{rank}.json").write_text(json.dumps(lengths))


def jobs(argv: list[str]) -> list[list[str]]:
    """``["update", "a", "+", "decode", "b"]`` -> ``[["update", "a"], ["decode", "b"]]``."""
    split: list[list[str]] = [[]]
    for arg in argv:
        split.append([]) if arg == "+" else split[-1].append(arg)
    return [job for job in split if job]


if __name__ == "__main__":
    from tests.server_ranks_job import server_ranks
    from tests.sharded_ddp import balance_failure, ddp_balanced, ddp_grads, nonfinite
    from tests.sharded_rollout_jobs import decode
    from tests.test_eval_metrics import synced_job

    modes = {"update": update, "fit": fit, "fit_recording_lengths": fit_recording_lengths, "decode": decode,
             "validate": validate, "metrics": synced_job, "validate_sets": validate_sets,
             "refused_resume": refused_resume, "ddp_grads": ddp_grads, "ddp_balanced": ddp_balanced,
             "balance_failure": balance_failure,
             "disagreeing_resume": disagreeing_resume, "nonfinite": nonfinite, "async_fit": async_fit,
             "async_estimators": async_estimators, "server_ranks": server_ranks}  # fmt: skip
    for mode, *args in jobs(sys.argv[1:]):
        modes[mode](*args)
    release_process_group()
