"""Bad configurations and inputs on configs/tiny.yaml: each refused in one line (exit 2) before any model loads, or
dropped and counted; a reward that always fails stops the run (split from tests/test_faults.py, which keeps the
kills, signals and run folders)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from sgrpo.checks import ConfigError
from sgrpo.eval.report import read_run_metrics
from sgrpo.fit import main
from sgrpo.model.tiny import build_char_tokenizer
from sgrpo.rollout.prompt_limits import prompt_limit, within_limit
from sgrpo.run.launch_checks import check_strategy
from sgrpo.types import Example
from tasks.base import Reward
from tests.preloaded import run
from tests.test_faults import REPO, TINY, args, error_line, last_step
from tests.test_faults import model_dir as model_dir  # the module's tiny model (a fixture)

# ------------------------------------------------------------------------------------------ bad input
BAD_CONFIGS = [
    ("lr-negative", ["--model.optimizer.init_args.lr=-1"], "model.optimizer"),
    ("lr-nan", ["--model.optimizer.init_args.lr=.nan"], "model.optimizer"),
    ("max-steps", ["--trainer.max_steps=-1"], "set trainer.max_steps (training steps) or trainer.max_epochs ("),
    ("max-steps-zero", ["--trainer.max_steps=0"], "trainer.max_steps must be >= 1, or -1 / unset for no limit"),
    ("max-epochs", ["--trainer.max_epochs=0"], "trainer.max_epochs must be >= 1, or -1 / unset for no limit"),
    ("model-folder", ["--model.model=./no/such/model"], "model: ./no/such/model does not exist"),
    ("data-file", ["--model.task=tasks.ReferenceText", "--model.task.init_args.path=./no/such.jsonl"], "no/such.jsonl"),
    ("remote-checkpoint", ["--ckpt_path=https://example.com/last.ckpt"], "remote checkpoints are refused"),
    ("gpus", ["--trainer.accelerator=gpu", "--trainer.devices=8"], "asks for 8 GPU(s)"),
    ("hub-model", ["--model.model=someone/no-such-model"], "model 'someone/no-such-model' is not in the local cache"),
    ("hub-dataset", ["--model.task=tasks.DeepMath", "--model.task.init_args.path=someone/no-such-data"],
     "dataset 'someone/no-such-data' is not in the local cache"),
    ("last-without-checkpoint", ["--ckpt_path=last"], "has none"),
    ("float16-training", ["--trainer.precision=16-true"], "16-true trains float16 weights, whose squared gradients"),
    ("float16-weights", ["--model.dtype=float16"], "model.dtype=float16 trains float16 weights"),
    ("clip-by-lightning", ["--trainer.gradient_clip_val=1.0"], "use model.max_grad_norm"),
    ("accumulate-by-lightning", ["--trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches is not for"),
    ("fractional-validation", ["--trainer.val_check_interval=0.5"], "val_check_interval must count training steps"),
    ("deepspeed-by-name", ["--trainer.strategy=deepspeed"], "trainer.strategy: DeepSpeedStrategy is not supported"),
    ("schedule-shorter-than-the-run", ["--model.scheduler=torch.optim.lr_scheduler.OneCycleLR",
                                       "--model.scheduler.init_args.max_lr=0.01",
                                       "--model.scheduler.init_args.total_steps=2"],
     "model.scheduler: Tried to step 3 times. The specified number of total steps is 2 at training step 3 of "
     "trainer.max_steps=3"),
    ("devices-0", ["--trainer.devices=0"], "invalid configuration: `Trainer(devices='0')` value is not a valid"),
    ("ddp-spawn", ["--trainer.strategy=ddp_spawn", "--trainer.devices=2"], "ddp_spawn sends the trainer to processes"),
    ("data-parallel-size", ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
                            "--trainer.strategy.init_args.data_parallel_size=4",
                            "--trainer.strategy.init_args.tensor_parallel_size=1", "--trainer.devices=2"],
     "with data_parallel_size=4 over 2 processes (devices x num_nodes): set data_parallel_size=2"),
    ("maxrl-pm1", ["--model.estimator=estimators.MaxRL", "--model.task.init_args.reward=tasks.ExactMatch",
                   "--model.task.init_args.reward.init_args.scale=pm1"],
     "model.estimator: MaxRL needs rewards >= 0 (it divides by the group mean), but reward 'exact_match' has scale"),
    ("limit-train-0", ["--trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 trains no step"),
    ("limit-train-fraction", ["--trainer.limit_train_batches=0.5"], "is a fraction of an epoch, which a run bounded"),
    ("logits-chunk-0", ["--model.logits_chunk_mib=0"], "logits_chunk_mib must be a finite number of MiB > 0, got 0"),
    ("completions-groups-0", ["--model.log_completions_groups=0"], "log_completions_groups must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "needle"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_configuration_fails_in_one_line_before_loading(extra, needle, model_dir, tmp_path, capsys,
                                                                 monkeypatch):  # fmt: skip
    if needle.startswith("asks for 8") and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the GPUs")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(SystemExit) as refused:
        main(args(tmp_path / "run", model_dir, "--trainer.max_steps=3", *extra))
    assert refused.value.code == 2
    assert needle in error_line(capsys)
    assert time.perf_counter() - started < 10
    assert not (tmp_path / "run" / "lightning_logs").exists()  # nothing ran


def test_vllm_rollout_without_vllm_is_refused_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch):
    """VLLMRollout imported vLLM at the first rollout: without it installed, the model had loaded (minutes on a
    7B) before the error. Now the preflight names the key and the install command."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, whether or not this venv has it
    for key in ("rollout", "val_rollout"):
        with pytest.raises(SystemExit) as refused:
            main(args(tmp_path / "run", model_dir, "--trainer.max_steps=1", f"--model.{key}=sgrpo.rollout.VLLMRollout",
                      f"--model.{key}.init_args.max_new_tokens=16"))
        line = error_line(capsys)
        assert refused.value.code == 2 and f"model.{key}: VLLMRollout needs vLLM, which is not installed" in line
        assert "pip install -e '.[vllm]'" in line
        assert not (tmp_path / "run" / "lightning_logs").exists()
    # validate samples with val_rollout only: a vLLM-trained run's config evaluates with HFRollout here
    cli = main(["validate", "--config", TINY, f"--model.model={model_dir}", f"--trainer.default_root_dir={tmp_path}",
                "--trainer.enable_progress_bar=false", "--model.rollout=sgrpo.rollout.VLLMRollout",
                "--model.rollout.init_args.max_new_tokens=16", "--model.val_rollout=sgrpo.rollout.HFRollout",
                "--model.val_rollout.init_args.max_new_tokens=8"])  # fmt: skip
    assert cli.model.last_evaluation["split"] == "validation"


def test_an_export_dir_holding_what_is_not_an_export_is_refused_before_loading(model_dir, tmp_path, capsys):
    """The fit's end replaces export_dir whole: a folder of a user's files, a file, the run folder or its parent
    (checkpoints and metrics with it) were deleted without a word (found by a review). Refused in one line now,
    before the model loads, and nothing is touched; a folder a fit exported to (its mark) is replaced."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "notes.txt").write_text("mine\n")
    (tmp_path / "file.txt").write_text("mine too\n")
    for target, needle in [(data, "holds what is not a fit's export (no sgrpo_export.json)"),
                           (tmp_path / "file.txt", "holds what is not a fit's export"),
                           (tmp_path / "run", "is the run folder or holds it"),
                           (tmp_path, "is the run folder or holds it")]:  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            main(args(tmp_path / "run", model_dir, "--trainer.max_steps=1", f"--model.export_dir={target}"))
        assert refused.value.code == 2 and needle in error_line(capsys), target
        assert not (tmp_path / "run" / "lightning_logs").exists()
    assert (data / "notes.txt").read_text() == "mine\n" and (tmp_path / "file.txt").is_file()
    export = tmp_path / "export"
    for name in ("first", "second"):  # the second run's export replaces the first's
        main(args(tmp_path / name, model_dir, "--trainer.max_steps=1", f"--model.export_dir={export}"))
        mark = json.loads((export / "sgrpo_export.json").read_text())
        assert mark["run"] == str(tmp_path / name) and mark["step"] == 1 and (export / "config.json").is_file()


@pytest.mark.slow
def test_a_step_that_does_not_split_over_the_processes_is_refused_before_loading_and_frees_the_folder(
    model_dir, tmp_path
):
    """3 prompts per step over 2 DDP processes: known once the processes exist, refused then in one line on
    each (exit 2), before the model loads; the folder, which holds only that start's config, then takes the
    corrected run without --overwrite."""
    extra = ["--trainer.max_steps=1", "--trainer.devices=2", "--trainer.strategy=ddp", "--model.prompts_per_step=3"]
    refused = run([sys.executable, "-m", "sgrpo.fit", *args(tmp_path, model_dir, *extra)], cwd=REPO,
                  env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=120)  # process 0 preloaded (tests/preloaded.py)
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: invalid configuration: model.prompts_per_step (3) must divide evenly over the 2 "
                     "data-parallel processes"] * 2  # fmt: skip
    assert "Traceback" not in refused.stderr and "Loading weights" not in refused.stderr
    assert [p.name for p in (tmp_path / "lightning_logs").rglob("*") if p.is_file()] == ["config.yaml"]
    main(args(tmp_path, model_dir, "--trainer.max_steps=1"))
    assert last_step(tmp_path) == 1


def test_strategies_whose_sharding_the_rollout_cannot_see_are_refused():
    """FSDP1 (Lightning's ``fsdp``) and DeepSpeed gather weights inside each forward, out of the rollout's
    sight: refused, naming FSDP2. (Lightning builds neither on CPU, so the check is called here directly; the
    supported strategies pass through it in every fit of the suite.)"""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    class DeepSpeedStrategy(DDPStrategy):  # the name Lightning's has (it needs the deepspeed package)
        pass

    for strategy in (SingleDeviceStrategy("cpu"), DDPStrategy(), ModelParallelStrategy()):
        check_strategy(strategy)
    for strategy in (FSDPStrategy(), DeepSpeedStrategy()):
        name = type(strategy).__name__
        with pytest.raises(ConfigError, match=f"trainer.strategy: {name} is not supported; shard with FSDP2"):
            check_strategy(strategy)


def test_an_empty_config_file_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(SystemExit) as refused:
        main(["--config", str(tmp_path / "empty.yaml")])
    assert refused.value.code == 2 and "empty.yaml is empty" in error_line(capsys)


def test_a_10_mb_question_is_dropped_without_being_tokenized():
    tokenizer = build_char_tokenizer()
    seen: list[int] = []
    tokenize = type(tokenizer).__call__

    def spy(self, texts, **kwargs):
        seen.extend(len(t) for t in texts)
        return tokenize(self, texts, **kwargs)

    huge = Example("s:" + "3" * 10_000_000 + "=", "3")
    examples = [Example("s:31=", "13"), huge, Example("s:" + "1" * 60 + "=", "1"), Example("s:2=", "2")]
    type(tokenizer).__call__ = spy
    try:
        kept, dropped = within_limit(examples, tokenizer, 56, "train")
    finally:
        type(tokenizer).__call__ = tokenize
    assert [e.prompt for e in kept] == ["s:31=", "s:2="] and dropped == 2
    assert max(seen) < 1000  # the 10 MB text never reached the tokenizer


def test_prompts_over_the_model_positions_are_dropped_and_counted(model_dir, tmp_path):
    from transformers import AutoConfig

    assert prompt_limit(AutoConfig.from_pretrained(model_dir), None, 8) == 64 - 8
    # sort prompts of 3 and 5 digits: "s:123=" is 6 tokens, "s:12345=" 8; half of the 256 are over 6
    cli = main(args(tmp_path, model_dir, "--trainer.max_steps=2", "--model.max_prompt_tokens=6",
                    "--validate_last=true"))
    assert cli.model.prompts_dropped == 128
    metrics = read_run_metrics(tmp_path)
    assert metrics["train/prompts_dropped"] == [(0, 128.0), (1, 128.0)]
    # validation's too: accuracy and pass@k cover the kept prompts only (it was a log line, in no metric)
    dropped = cli.model._within_prompt_limit("validation")[1]
    assert dropped > 0 and metrics["val/prompts_dropped"] == [(2, float(dropped))]
    assert cli.model.val_history[-1]["prompts_dropped"] == dropped


@pytest.mark.parametrize(
    ("command", "split"),
    [(["--trainer.max_steps=2"], "train"),
     (["--trainer.max_steps=2", "--trainer.val_check_interval=1", "--model.val_rollout=sgrpo.rollout.HFRollout",
      "--model.val_rollout.init_args.max_new_tokens=61"],
      "validation")],  # train prompts have room for 8 new tokens; validation's for 3, shorter than any prompt
    ids=["train", "validation"],
)  # fmt: skip
def test_a_split_whose_every_prompt_is_over_the_limit_is_refused_before_the_weights_load(
    command, split, model_dir, tmp_path, capsys, monkeypatch
):
    """The prompts are screened once the tokenizer is loaded, before the weights (a 7B model's minutes); the
    loaders then take the screened splits, each prompt tokenized once."""
    import sgrpo.policy_model

    monkeypatch.setattr(sgrpo.policy_model, "load_causal_lm", lambda *a: pytest.fail("the weights loaded"))
    extra = ["--model.max_prompt_tokens=3"] if split == "train" else []  # sort prompts have 6 tokens or more
    with pytest.raises(SystemExit) as refused:
        main(args(tmp_path, model_dir, *command, *extra))
    assert refused.value.code == 2
    assert f"every {split} prompt is longer than the prompt limit" in error_line(capsys)


def test_each_prompt_is_tokenized_once_and_a_split_the_fit_does_not_read_is_not_screened(model_dir, tmp_path,
                                                                                           monkeypatch):  # fmt: skip
    import sgrpo.policy_model

    screened = []
    within = sgrpo.policy_model.within_limit
    monkeypatch.setattr(sgrpo.policy_model, "within_limit", lambda ex, tok, limit, split, rendered: (
        screened.append(split), within(ex, tok, limit, split, rendered))[1])  # fmt: skip
    main(args(tmp_path, model_dir, "--trainer.max_steps=2", "--trainer.limit_val_batches=0"))
    assert screened == ["train"]


class AlwaysFails(Reward):
    """A reward whose scoring always raises."""

    name = "always_fails"

    def score(self, examples, completions):
        raise RuntimeError("the grader is not installed")


def test_a_reward_that_always_fails_stops_the_run(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(args(tmp_path, model_dir, "--trainer.max_steps=10", "--model.reward_failure_steps=2",
                  "--model.task.init_args.reward=tests.test_faults_input.AlwaysFails"))  # fmt: skip
    assert stopped.value.code == 1
    line = error_line(capsys)
    assert "the reward failed for 16 of 16 completions" in line and "2 steps in a row" in line
    # both failing steps trained (on zeros) and were logged, then it stopped (the second's row was lost)
    assert last_step(tmp_path) == 2
    assert read_run_metrics(tmp_path)["train/reward/failures"] == [(0, 16.0), (1, 16.0)]


def test_under_dynamic_sampling_the_failing_reward_counts_steps_not_rounds(model_dir, tmp_path, capsys):
    """A reward that always fails leaves every group constant, so every refill round runs: each round used to count
    as a failed step (4 rounds: stopped within step 1 of reward_failure_steps 2), and the metric held round 1's."""
    with pytest.raises(SystemExit) as stopped:
        main(args(tmp_path, model_dir, "--trainer.max_steps=10", "--model.reward_failure_steps=2",
                  "--model.dynamic_sampling=true", "--model.max_sampling_rounds=3",
                  "--model.task.init_args.reward=tests.test_faults_input.AlwaysFails"))  # fmt: skip
    assert stopped.value.code == 1
    assert "the reward failed for 48 of 48 completions" in error_line(capsys)
    assert last_step(tmp_path) == 2
    assert read_run_metrics(tmp_path)["train/reward/failures"] == [(0, 48.0), (1, 48.0)]


@pytest.mark.parametrize("mode", ["fit", "validate"])
def test_an_empty_generated_split_is_refused_in_one_line_before_the_model_loads(mode, model_dir, tmp_path, capsys,
                                                                                  monkeypatch):  # fmt: skip
    """num_train: 0 ended in a ValueError traceback from the prompt stream, later in one line but after the model had
    loaded; ``validate`` of num_validation: 0 evaluated nothing, printed no table and exited 0. An empty validation
    split in a fit only skips its validations (the fits of tests/vllm_fakes.py have none)."""
    from sgrpo.policy import GRPOPolicy

    monkeypatch.setattr(GRPOPolicy, "_load_model", lambda *a: pytest.fail("the model loaded"))
    split = "train" if mode == "fit" else "validation"
    command = ["validate"] if mode == "validate" else []
    with pytest.raises(SystemExit) as refused:
        main([*command, *args(tmp_path, model_dir, "--trainer.max_steps=2", f"--model.task.init_args.num_{split}=0")])
    assert refused.value.code == 2
    assert error_line(capsys) == (f"error: invalid configuration: model.task ({split} split): SyntheticTask makes "
                                  f"no {split} examples: give "
                                  f"model.task.init_args.num_{split} a count >= 1")  # fmt: skip


def test_a_reward_below_zero_by_its_settings_is_named_for_a_nonnegative_estimator():
    from sgrpo.run.preflight import signed_reward
    from tasks import ExactMatch, WeightedSum

    assert signed_reward(ExactMatch()) is None
    assert signed_reward(WeightedSum([ExactMatch(), ExactMatch(name="again")], [1.0, 0.5])) is None
    assert signed_reward(WeightedSum([ExactMatch(), ExactMatch(name="again")], [1.0, -0.5])) == (
        "reward 'weighted_sum' weighs its part 'again' by -0.5")
    nested = WeightedSum([ExactMatch(), WeightedSum([ExactMatch(name="pm", scale="pm1")], name="inner")])
    assert signed_reward(nested) == "reward 'pm' has scale 'pm1' (a wrong answer scores -1)"


def test_episodes_over_fsdp2_processes_without_gathered_weights_are_refused_before_launch(tmp_path, capsys):
    """Each process would decode turns through forwards that gather their shards, while the others had run out of
    turns: it raised at the first rollout, after every process loaded and sharded the model (found by a review)."""
    with pytest.raises(SystemExit) as refused:
        main(["--config", str(REPO / "configs" / "tools_quickstart.yaml"), f"--trainer.default_root_dir={tmp_path}",
              "--trainer.devices=2", "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
              "--trainer.strategy.init_args.data_parallel_size=2",
              "--trainer.strategy.init_args.tensor_parallel_size=1",
              "--model.rollout.init_args.weights_snapshot=false"])  # fmt: skip
    assert refused.value.code == 2
    assert "model.rollout.init_args.weights_snapshot=false: multi-turn episodes" in error_line(capsys)
