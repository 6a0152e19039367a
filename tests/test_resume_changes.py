"""A resume with another experiment is refused in one line naming each change, or, allowed, applied whole:
the optimiser's settings too, which loading its state used to put back silently."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sgrpo.run.resume import (
    ProcessesDisagree,
    apply_optimizer_settings,
    base_change,
    content_disagreement,
    content_fingerprint,
    drop_scheduler_state,
    experiment_changes,
    experiment_record,
)
from tests.gloo_pair import run_pair


def record(**model):
    base = {"group_size": 4, "estimator": {"class_path": "estimators.SoftmaxGRPO", "init_args": {"temperature": 0.5}},
            "micro_batch_size": 2, "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.001}}}
    return experiment_record(base | model, seed=0)  # fmt: skip


def test_changes_name_each_key_and_a_new_class_in_one_line():
    grpo = {"class_path": "estimators.GRPO", "init_args": {"std": "sample"}}
    assert experiment_changes(record(), record(group_size=8, estimator=grpo, micro_batch_size=1)) == [
        'model.estimator.class_path: "estimators.SoftmaxGRPO" -> "estimators.GRPO"',
        "model.group_size: 4 -> 8",
    ]  # micro-batching changes how a step is computed, not what: not a change of experiment
    assert experiment_changes(record(), record()) == []
    fused = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.001, "fused": True}}  # how AdamW steps, not
    assert experiment_changes(record(), record(optimizer=fused)) == []  # what: a GPU run resumed on CPU, say
    fused["init_args"]["lr"] = 0.002
    assert experiment_changes(record(), record(optimizer=fused)) == ["model.optimizer.init_args.lr: 0.001 -> 0.002"]
    assert experiment_changes(record(), experiment_record({"group_size": 4}, seed=1))[-1] == "seed_everything: 0 -> 1"


def test_the_rollout_engine_s_memory_settings_may_change_on_resume():
    """A resume after vLLM ran out of memory lowers ``gpu_memory_utilization``: it was refused as another experiment.
    What the engine samples (its class, temperature, token caps) still counts."""
    engine = {"class_path": "sgrpo.rollout.VLLMRollout", "init_args": {"gpu_memory_utilization": 0.4, "sleep": True,
              "enforce_eager": False, "weight_chunk_mib": 512.0, "temperature": 1.0}}  # fmt: skip
    lower = {"class_path": "sgrpo.rollout.VLLMRollout", "init_args": {"gpu_memory_utilization": 0.3, "sleep": False,
             "enforce_eager": True, "weight_chunk_mib": 128.0, "temperature": 1.0}}  # fmt: skip
    assert experiment_changes(record(rollout=engine), record(rollout=lower)) == []
    hf = {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"weights_snapshot": None, "cuda_graphs": False}}
    graphs = {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"weights_snapshot": False, "cuda_graphs": True}}
    assert experiment_changes(record(rollout=hf), record(rollout=graphs)) == []
    rows = {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"max_batch_rows": 40}}  # chunks reorder the draws
    assert experiment_changes(record(rollout=hf | {"init_args": {"max_batch_rows": 512}}), record(rollout=rows)) == [
        "model.rollout.init_args.max_batch_rows: 512 -> 40"]
    lower["init_args"]["temperature"] = 0.7
    assert experiment_changes(record(rollout=engine), record(rollout=lower)) == [
        "model.rollout.init_args.temperature: 1.0 -> 0.7"]


def test_evaluation_logging_and_wait_settings_may_change_on_resume():
    """docs/training.md: logging and evaluation settings may change freely; the producer's timeout error says to
    raise ``model.producer_timeout``, and its resume was refused as another experiment."""
    judge = {"class_path": "tasks.judge.JudgeReward", "init_args": {}}
    assert experiment_changes(record(val_reward=None, log_mgf_temperature=None, producer_timeout=600.0),
                              record(val_reward=judge, log_mgf_temperature=0.5, producer_timeout=1800.0)) == []
    assert experiment_changes(record(max_staleness=1), record(max_staleness=2)) == ["model.max_staleness: 1 -> 2"]


def test_a_setting_added_since_the_checkpoint_is_a_change_only_when_set():
    """A checkpoint from before ``model.environment`` existed resumes with it null (single-turn, as it trained)."""
    tool = {"class_path": "tasks.environment.ToolEnvironment", "init_args": {"tools": ["m.f"]}}
    assert experiment_changes(record(), record(environment=None)) == []
    assert experiment_changes(record(), record(environment=tool)) == [
        "model.environment.class_path: unset -> \"tasks.environment.ToolEnvironment\""
    ]
    assert experiment_changes(record(environment=tool), record(environment=None))[0].startswith("model.environment")


def test_a_checkpoint_from_before_max_batch_rows_was_recorded_resumes():
    """``max_batch_rows`` was operational, so older checkpoints lack it: they were refused as "unset -> 512"."""
    hf = {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"temperature": 1.0}}
    rows = {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"temperature": 1.0, "max_batch_rows": 512}}
    assert experiment_changes(record(rollout=hf), record(rollout=rows)) == []
    assert experiment_changes(record(rollout=rows), record(rollout=hf)) == ["model.rollout.init_args.max_batch_rows: "
                                                                            "512 -> unset"]  # fmt: skip


def test_hidden_files_of_a_folder_are_not_its_content(tmp_path):
    """``hf download --local-dir`` rewrites a time stamp under ``.cache/huggingface`` at each run: a job that
    downloads before each resubmission was refused as another model."""
    base = tmp_path / "model"
    (base / ".cache" / "huggingface").mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / ".cache" / "huggingface" / "model.metadata").write_text("abc\n1764000000.1\n")
    before = content_fingerprint(base)
    (base / ".cache" / "huggingface" / "model.metadata").write_text("abc\n1764999999.25\n")
    (base / ".git").mkdir()
    (base / ".git" / "HEAD").write_text("ref: main\n")
    assert content_fingerprint(base) == before
    (base / "config.json").write_text('{"a": 1}')
    assert content_fingerprint(base) != before


def test_a_record_from_before_hidden_files_were_skipped_still_matches(tmp_path):
    """Checkpoints saved before hidden files left the fingerprint recorded them in it: the same model folder (with
    hf download's .cache) was refused on resume, and its LoRA checkpoint refused by validate."""
    base = tmp_path / "model"
    (base / ".cache" / "huggingface").mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / ".cache" / "huggingface" / "model.metadata").write_text("abc\n1764000000.1\n")
    now = experiment_record({"model": str(base)}, 0)
    old = now | {"model.model@content": json.dumps(content_fingerprint(base, hidden=True))}
    assert old != now and experiment_changes(old, now) == [] and base_change(old, str(base)) is None
    (base / "config.json").write_text('{"a": 1}')  # another model: still a change, in either form
    changed = experiment_record({"model": str(base)}, 0)
    assert experiment_changes(old, changed)[0].startswith("model.model@content: ")
    assert base_change(old, str(base)).startswith("model.model@content: ")
    hub = experiment_record({"model": "Qwen/Qwen2.5-1.5B"}, 0)  # trained from a hub id: a local folder may be its
    assert base_change(hub, str(base)) is None and base_change(now, "Qwen/Qwen2.5-1.5B") is None  # snapshot
    assert base_change(hub, "Qwen/Qwen2.5-0.5B") == 'model.model: "Qwen/Qwen2.5-1.5B" -> "Qwen/Qwen2.5-0.5B"'


def test_the_same_model_and_data_under_another_path_are_no_change(tmp_path, monkeypatch):
    """A run trained on ``model`` (relative) resumed with its absolute path, or with a copy elsewhere, was refused
    (``model.model: "model" -> "/.../model"``, after the model loaded) though both records fingerprint the same
    content; a data file likewise. Another content at the new path is still a change."""
    import shutil

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    task = {"class_path": "tasks.DeepMath", "init_args": {"path": "train.jsonl"}}
    trained = experiment_record({"model": "model", "task": task}, 0)
    shutil.copytree(tmp_path / "model", tmp_path / "copy")
    shutil.copy(tmp_path / "train.jsonl", tmp_path / "moved.jsonl")
    moved = {"class_path": "tasks.DeepMath", "init_args": {"path": str(tmp_path / "moved.jsonl")}}
    for model in (str(tmp_path / "model"), "copy"):
        assert experiment_changes(trained, experiment_record({"model": model, "task": moved}, 0)) == []
    (tmp_path / "copy" / "config.json").write_text('{"a": 1}')
    changes = experiment_changes(trained, experiment_record({"model": "copy", "task": moved}, 0))
    assert [c.split(":")[0] for c in changes] == ["model.model", "model.model@content"]


def test_processes_that_see_other_content_at_a_path_are_named():
    """Each process fingerprints its own copy: a node whose model differed refused the resume alone, and the others
    waited in a collective. ``agree_checkpoint`` compares the records first (every process raises)."""
    same = {"model.model": '"m"', "model.model@content": '"10 bytes, aa"', "model.group_size": "4"}
    assert content_disagreement([same, dict(same), dict(same)]) is None
    other = same | {"model.model@content": '"11 bytes, bb"'}
    assert content_disagreement([same, other, dict(same), other]) == (
        "model.model: processes 1, 3 see other content there than process 0 (11 bytes, bb against 10 bytes, aa): "
        "another copy of the model or data on another node; make every process see the same files")
    missing = {k: v for k, v in same.items() if k != "model.model@content"}  # no such path on process 1
    assert "process 1 sees other content there than process 0 (nothing against" in content_disagreement([same, missing])


def _agree_on(rank: int, experiment: dict) -> str | None:
    from sgrpo.run.folders import agree_checkpoint

    try:
        agree_checkpoint(SimpleNamespace(world_size=2), None, experiment=experiment)
    except ProcessesDisagree as err:
        return str(err)
    return None


def test_every_process_refuses_when_one_sees_another_model(tmp_path):
    records = [{"model.model@content": '"1 bytes, a"'}, {"model.model@content": '"2 bytes, b"'}]
    seen = run_pair(_agree_on, records, tmp_path)
    assert seen[0] == seen[1] and seen[0].startswith("model.model: process 1 sees other content there")
    assert run_pair(_agree_on, [records[0], records[0]], tmp_path / "same") == {0: None, 1: None}


@pytest.mark.parametrize("scheduled", [False, True])
def test_allowed_changes_set_the_optimisers_settings_over_the_loaded_state(scheduled):
    weight = torch.nn.Parameter(torch.ones(2))
    old = torch.optim.AdamW([weight], lr=0.001, weight_decay=0.0)
    old_schedule = torch.optim.lr_scheduler.LambdaLR(old, lambda step: 0.5) if scheduled else None
    new = torch.optim.AdamW([weight], lr=0.01, weight_decay=0.1)  # the resumed config's
    schedule = torch.optim.lr_scheduler.LambdaLR(new, lambda step: 0.5) if scheduled else None
    new.load_state_dict(old.state_dict())  # as a resume loads it: the old lr and weight decay are back
    if scheduled:
        schedule.load_state_dict(old_schedule.state_dict())
    assert new.param_groups[0]["lr"] == (0.0005 if scheduled else 0.001)
    apply_optimizer_settings([new], [schedule] if scheduled else [])
    group = new.param_groups[0]
    assert group["weight_decay"] == 0.1 and group["lr"] == pytest.approx(0.005 if scheduled else 0.01)
    if scheduled:  # the schedule's factor (0.5) of the new base from the next step on
        assert schedule.base_lrs == [0.01]
        schedule.step()
        assert group["lr"] == pytest.approx(0.005)


@pytest.mark.slow
def test_a_resume_with_another_experiment_is_refused_or_applied(tmp_path, capsys):
    from pathlib import Path

    from sgrpo.fit import main

    def fit(*extra):
        config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
        main(["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
              "--trainer.limit_val_batches=0", *extra])  # fmt: skip

    fit("--trainer.max_steps=2")
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        fit("--trainer.max_steps=3", "--ckpt_path=last", "--model.estimator=estimators.GRPO")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert refused.value.code == 2 and last.read_bytes() == before  # nothing written, the run kept
    assert len(errors) == 1 and 'model.estimator.class_path: "estimators.SoftmaxGRPO" -> "estimators.GRPO"' in errors[0]
    assert "--resume_changes allow" in errors[0]

    fit("--trainer.max_steps=3", "--ckpt_path=last", "--model.optimizer.init_args.lr=0.01", "--resume_changes=allow")
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 3 and [g["lr"] for g in saved["optimizer_states"][0]["param_groups"]] == [0.01]


def test_seed_everything_true_is_recorded_as_the_setting_so_a_resume_is_the_same_experiment(tmp_path, monkeypatch):
    """Lightning resolves ``seed_everything: true`` at every start into a seed: the one in ``PL_GLOBAL_SEED`` where
    the environment has it (a launcher, an earlier seeding in the job), else 0 (Lightning 2.6; older versions drew
    one at random). The record keeps the setting, ``true``, so two starts of the same config (a run and its resume)
    that resolve it differently record the same experiment (before: 11 -> 22, refused as another experiment)."""
    from pathlib import Path

    from sgrpo.fit import parse
    from sgrpo.run.saving import RunCheckpoint

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    records, seeds = [], []
    for drawn in ("11", "22"):
        monkeypatch.setenv("PL_GLOBAL_SEED", drawn)
        cli = parse(["--config", str(config), f"--trainer.default_root_dir={tmp_path}", "--seed_everything=true"])
        records.append(next(c for c in cli.trainer.callbacks if isinstance(c, RunCheckpoint)).experiment)
        seeds.append(cli.config["seed_everything"])
    assert seeds == [11, 22]  # Lightning still seeds each start
    assert records[0]["seed_everything"] == "true" and experiment_changes(records[0], records[1]) == []


def trained(schedule, steps: int, lr: float = 1e-3):
    """An AdamW (and its ``schedule(optimizer)`` or None) after ``steps`` training steps: (optimizer, scheduler)."""
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([parameter], lr=lr)
    scheduler = schedule(optimizer) if schedule else None
    for _ in range(steps):
        parameter.grad = torch.ones(2)
        optimizer.step()
        if scheduler:
            scheduler.step()
    return optimizer, scheduler


def linear(total):
    return lambda optimizer: torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=total)


@pytest.mark.parametrize("before, after", [(4, 8), (None, 8), (4, None), (4, 4)],
                         ids=["changed", "added", "removed", "unchanged"])  # fmt: skip
def test_a_schedule_changed_on_resume_stands_where_a_run_with_it_from_the_start_would(before, after):
    """Resumed after 2 steps with another LinearLR (``total_iters`` ``before`` -> ``after``; None: no scheduler):
    torch's ``load_state_dict`` put the old arguments back (the old 4-step schedule ran on, the log saying 8); one
    added raised ``KeyError: 'initial_lr'``; one removed kept its last factor for good. A changed schedule now
    restarts, stepped once per step done; an unchanged one loads as before."""
    schedule = lambda total: None if total is None else linear(total)  # noqa: E731
    old_optimizer, old_scheduler = trained(schedule(before), 2)
    checkpoint = {"lr_schedulers": [old_scheduler.state_dict()] if old_scheduler else []}
    changes = experiment_changes(record(scheduler=before), record(scheduler=after))
    assert bool(changes) == (before != after)
    drop_scheduler_state(checkpoint, changes)
    optimizer, scheduler = trained(schedule(after), 0)  # configure_optimizers with the new config, then the state loads
    optimizer.load_state_dict(old_optimizer.state_dict())
    for state in checkpoint["lr_schedulers"]:
        scheduler.load_state_dict(state)
    apply_optimizer_settings([optimizer], [scheduler] if scheduler else [], changes, steps=2)
    reference, _ = trained(schedule(after), 2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12)
    assert ("initial_lr" in optimizer.param_groups[0]) == (after is not None)
    if scheduler:  # a third step continues the new schedule: LinearLR's closed form, lr (1 - 0.9 min(t, T) / T)
        scheduler.step()
        assert scheduler.total_iters == after
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 0.9 * min(3, after) / after), rel=1e-9)


def test_another_base_model_under_the_same_path_is_a_change(tmp_path, capsys):
    """A LoRA run's frozen base, the tokenizer and a KL reference come from ``model.model``'s folder, not the
    checkpoint: another model copied there resumed silently."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from sgrpo.fit import main

    repo = Path(__file__).resolve().parents[1]
    base = tmp_path / "base"
    shutil.copytree(repo / "sgrpo" / "assets" / "quickstart_model", base)
    assert experiment_record({"model": str(base)}, 0) == experiment_record({"model": str(base)}, 0)

    def fit(*extra):
        main(["--config", str(repo / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path / 'run'}",
              "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", f"--model.model={base}",
              "--model.loss=sgrpo.train.loss.ClippedSurrogate", "--model.loss.init_args.kl_coef=0.1",
              *extra])  # fmt: skip

    fit("--trainer.max_steps=1")
    weights = load_file(base / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, base / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        fit("--trainer.max_steps=2", "--ckpt_path=last")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert refused.value.code == 2 and len(errors) == 1 and "model.model@content: " in errors[0]
