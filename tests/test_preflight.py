"""Preflight refusals (sgrpo.run.preflight): one line naming the key and the fix, exit 2, before any model loads."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgrpo.checks import ConfigError
from sgrpo.fit import main
from sgrpo.model.tiny import build_char_tokenizer, build_tiny_llama, ensure_tiny_model
from sgrpo.rollout import HFRollout
from sgrpo.rollout.prompt_limits import prompt_room
from sgrpo.rollout.vllm_engine import VLLMRollout
from sgrpo.run.launch_checks import check_tensor_parallel
from sgrpo.run.precision import BF16_MIN_ADAM_LR, check_weight_precision

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def refusal(tmp_path: Path, model_dir: str, capsys, *extra: str) -> str:
    """The one error line of a fit of configs/tiny.yaml refused before anything ran."""
    started = time.perf_counter()
    with pytest.raises(SystemExit) as refused:
        main([
            "--config", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}", f"--model.model={model_dir}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", *extra,
        ])  # fmt: skip
    assert refused.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert time.perf_counter() - started < 10
    assert not (tmp_path / "run" / "lightning_logs").exists()  # nothing ran
    return lines[0]


# ------------------------------------------------------------------------------ bfloat16 weights and Adam
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--trainer.precision=bf16-true", "--model.optimizer.init_args.lr=1e-6"],
         "trainer.precision=bf16-true trains bfloat16 weights at lr 1e-06, where AdamW's steps round away"),
        (["--model.dtype=bfloat16", "--model.optimizer.init_args.lr=1e-5"],
         "model.dtype=bfloat16 trains bfloat16 weights at lr 1e-05, where AdamW's steps round away"),
        (["--trainer.precision=bf16-mixed", "--model.dtype=bfloat16", "--model.optimizer=torch.optim.RMSprop",
          "--model.optimizer.init_args.lr=1e-6"], "model.dtype=bfloat16 trains bfloat16 weights at lr 1e-06"),
    ],
    ids=["bf16-true", "dtype-bfloat16", "bf16-mixed-bfloat16-weights"],
)  # fmt: skip
def test_bfloat16_weights_at_a_learning_rate_that_rounds_away_are_refused(extra, needle, model_dir, tmp_path,
                                                                          capsys):  # fmt: skip
    line = refusal(tmp_path, model_dir, capsys, *extra)
    assert needle in line
    assert "--trainer.precision=bf16-mixed with --model.dtype=float32 (float32 master weights)" in line
    assert "2^-9" in line and "3.9e-05" in line


def _policy(dtype: str, optimizer) -> SimpleNamespace:
    return SimpleNamespace(model_dtype=dtype, optimizer_factory=optimizer)


def test_the_bfloat16_rule_refuses_only_adam_like_steps_below_the_bound():
    adamw = lambda lr: lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
    check_weight_precision("bf16-mixed", _policy("float32", adamw(1e-6)))  # float32 master weights
    check_weight_precision("bf16-true", _policy("float32", adamw(1e-3)))  # a step above the bound
    check_weight_precision("bf16-true", _policy("float32", lambda p: torch.optim.SGD(p, lr=1e-6)))  # no eps
    check_weight_precision("64-true", _policy("bfloat16", adamw(1e-6)))  # 64-true converts them to float64
    with pytest.raises(ConfigError, match="bf16-true trains bfloat16 weights at lr 3.8e-05"):
        check_weight_precision("bf16-true", _policy("float32", adamw(3.8e-5)))
    with pytest.raises(ConfigError, match="16-true trains float16 weights"):  # float16: refused at any lr
        check_weight_precision("16-true", _policy("float32", adamw(1e-2)))


def test_the_bound_is_where_bfloat16_loses_adam_steps_on_the_tiny_model():
    """The rule's numbers, measured: below ``BF16_MIN_ADAM_LR`` (0.02 * 2^-9) an AdamW step moves no bfloat16
    weight of magnitude >= 0.02, and over 10 steps at lr 1e-6 almost no weight of the tiny model (N(0, 0.02))
    moves; at lr 1e-3, almost every one does."""
    tokenizer = build_char_tokenizer()
    ids = torch.randint(3, len(tokenizer), (8, 16), generator=torch.Generator().manual_seed(0))

    def unchanged(lr: float, steps: int) -> tuple[float, bool]:
        model = build_tiny_llama(tokenizer).to(torch.bfloat16)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        same = [(p == b) for p, b in zip(model.parameters(), before, strict=True)]
        share = sum(s.sum().item() for s in same) / sum(s.numel() for s in same)
        large_kept = all(s[b.abs() >= 0.02].all() for s, b in zip(same, before, strict=True))
        return share, large_kept

    assert unchanged(0.99 * BF16_MIN_ADAM_LR, 1)[1]  # no weight with |w| >= 0.02 moved
    assert not unchanged(4 * BF16_MIN_ADAM_LR, 1)[1]  # above 0.02 * 2^-8 they do
    assert unchanged(1e-6, 10)[0] > 0.95  # measured 98.0 %
    assert unchanged(1e-3, 10)[0] < 0.05  # measured 0.8 %


# ---------------------------------------------------------------------------- prompts and the engine's length
class ShortEngine(HFRollout):
    """An engine with a total-length limit of its own (as vLLM's ``max_model_len``), here 14 tokens."""

    max_total_tokens = 14


def test_vllm_bounds_prompts_by_its_max_model_len():
    """The numbers configs/scale_deepmath_8gpu.yaml had: Qwen2.5-1.5B's 32,768 positions allowed prompts of 30,720
    tokens beside 2,048 new ones, in an engine that takes 4,096; now the engine's length bounds them."""
    engine = VLLMRollout(max_new_tokens=2048, max_model_len=4096)
    assert engine.max_total_tokens == 4096 and VLLMRollout(max_new_tokens=8).max_total_tokens is None
    assert HFRollout().max_total_tokens is None  # the model's positions
    assert prompt_room(32768, engine.max_total_tokens, None, 2048) == 2048
    assert prompt_room(32768, None, None, 2048) == 30720  # without an engine limit: the positions
    assert prompt_room(None, None, None, 2048) is None
    with pytest.raises(ConfigError, match=r"max_prompt_tokens=30720 \+ model.rollout max_new_tokens=2048 exceed "
                                          r"model.rollout's max_model_len \(4096 tokens\).*<= 2048"):  # fmt: skip
        prompt_room(32768, 4096, 30720, 2048)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--model.rollout=sgrpo.rollout.VLLMRollout", "--model.rollout.init_args.max_new_tokens=8",
          "--model.rollout.init_args.max_model_len=16", "--model.max_prompt_tokens=12"],
         "model.max_prompt_tokens=12 + model.rollout max_new_tokens=8 exceed model.rollout's max_model_len (16 "
         "tokens)"),
        (["--model.max_prompt_tokens=60"],  # the tiny model's config.json: 64 positions, 8 new tokens
         "model.max_prompt_tokens=60 + model.rollout max_new_tokens=8 exceed the model's max_position_embeddings"),
        (["--model.val_rollout=sgrpo.rollout.HFRollout", "--model.val_rollout.init_args.max_new_tokens=64"],
         "model.val_rollout max_new_tokens=64 leaves no room for a prompt in the model's max_position_embeddings"),
    ],
    ids=["vllm-max-model-len", "model-positions", "val-rollout"],
)  # fmt: skip
def test_prompts_that_cannot_fit_the_engine_are_refused_before_loading(extra, needle, model_dir, tmp_path,
                                                                       capsys):  # fmt: skip
    assert needle in refusal(tmp_path, model_dir, capsys, "--trainer.max_steps=2", *extra)


def test_the_prompt_guard_drops_prompts_over_the_engine_length(model_dir, tmp_path):
    """An engine that takes 14 tokens with 8 new ones leaves 6 for a prompt: the 128 sort prompts of 5 digits
    ("s:12345=", 8 tokens) are dropped at read, not sent to the engine (the model's 64 positions allow 56)."""
    cli = main([
        "--config", TINY, f"--trainer.default_root_dir={tmp_path}", f"--model.model={model_dir}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_steps=1",
        "--trainer.val_check_interval=1000", "--model.rollout=tests.test_preflight.ShortEngine",
        "--model.rollout.init_args.max_new_tokens=8",
    ])  # fmt: skip
    assert cli.model.prompts_dropped == 128


# ------------------------------------------------------------------------------------------ tensor parallel
def test_tensor_parallel_model_parallel_strategy_is_refused():
    """sgrpo applies no tensor-parallel plan: ``tensor_parallel_size > 1`` (and "auto", which Lightning resolves
    to every device of a node) is refused, naming data_parallel_size; FSDP2 alone passes."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    def strategy(devices: int, **sizes) -> ModelParallelStrategy:
        built = ModelParallelStrategy(**sizes)
        built.parallel_devices = [torch.device("cpu")] * devices
        return built

    for passes in (strategy(4, data_parallel_size=4, tensor_parallel_size=1), strategy(1), DDPStrategy()):
        check_tensor_parallel(passes)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 is not implemented in sgrpo .*: set "
                                          r"data_parallel_size=4 and tensor_parallel_size=1"):  # fmt: skip
        check_tensor_parallel(strategy(4, data_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=auto \(8 devices\) is not implemented"):
        check_tensor_parallel(strategy(8))


def test_a_tensor_parallel_config_is_refused_in_one_line_before_launching(model_dir, tmp_path, capsys):
    line = refusal(tmp_path, model_dir, capsys, "--trainer.devices=2",
                   "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
                   "--trainer.strategy.init_args.data_parallel_size=1",
                   "--trainer.strategy.init_args.tensor_parallel_size=2")  # fmt: skip
    assert "tensor_parallel_size=2 is not implemented in sgrpo" in line and "data_parallel_size=2 and" in line


# ------------------------------------------------------------------------------------------ several nodes
def test_several_nodes_started_by_hand_are_refused_in_one_line_not_left_waiting(model_dir, tmp_path, capsys,
                                                                                 monkeypatch):  # fmt: skip
    """``--trainer.num_nodes=2`` run as ``python -m sgrpo.fit`` on one node (configs/deepmath_softmax.yaml without
    srun) waited for the second node in the rendezvous for 30 minutes, printing nothing; now one line, exit 2."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    from sgrpo.run.launch_checks import check_nodes

    for name in ("NODE_RANK", "GROUP_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    line = refusal(tmp_path, model_dir, capsys, "--trainer.num_nodes=2", "--trainer.strategy=lightning.pytorch."
                   "strategies.DDPStrategy", "--trainer.strategy.init_args.timeout=0:00:20")  # a regression: 20 s
    assert "trainer.num_nodes=2, but nothing started the other node(s)" in line and "srun" in line
    for nodes, environment in ((1, LightningEnvironment()), (2, TorchElasticEnvironment())):  # launched: passes
        check_nodes(SimpleNamespace(num_nodes=nodes, strategy=SimpleNamespace(cluster_environment=environment)))
    monkeypatch.setenv("NODE_RANK", "1")  # Lightning's launch by hand: every node given its rank
    check_nodes(SimpleNamespace(num_nodes=2, strategy=SimpleNamespace(cluster_environment=LightningEnvironment())))


def test_a_scheduler_that_takes_bfloat16_steps_below_the_bound_is_warned():
    """The base lr passes the bound, but a linear decay to 0 over 100 steps crosses it at step 97 (lr 3e-5)."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    decay = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / 100)  # noqa: E731
    policy = SimpleNamespace(model_dtype="bfloat16", optimizer_factory=adamw, scheduler_factory=decay)
    with pytest.warns(UserWarning, match=r"model.scheduler takes the lr to 3e-05 at step 97, below 3.9e-05"):
        check_weight_precision("bf16-true", policy, max_steps=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_weight_precision("bf16-true", policy, max_steps=96)  # the run ends before the crossing
        check_weight_precision("bf16-mixed", SimpleNamespace(**{**vars(policy), "model_dtype": "float32"}), 100)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--trainer.val_check_interval=0"], "error: invalid configuration: trainer.val_check_interval must be >= 1"),
        (["--model.rollout.init_args.temperature=0"], "error: invalid configuration: temperature must be > 0"),
        (["--model.rollout.init_args.max_new_tokens=0"], "error: invalid configuration: max_new_tokens must be"),
        (["--model.scheduler=torch.optim.lr_scheduler.StepLR", "--model.scheduler.init_args.step_size=0"],
         "error: invalid configuration: model.scheduler: integer modulo by zero"),
        (["--model.val_prompts_per_batch=0"], "error: invalid configuration: val_samples and val_prompts_per_batch"),
    ],
    ids=["val_check_interval", "temperature", "max_new_tokens", "scheduler_step", "val_prompts_per_batch"],
)
def test_bad_values_fail_in_one_line_not_a_traceback_or_a_union_dump(extra, needle, model_dir, tmp_path, capsys):
    """val_check_interval 0 raised ZeroDivisionError once the model had loaded; temperature or max_new_tokens 0
    printed an eight-line union dump with the message in the middle."""
    assert refusal(tmp_path, model_dir, capsys, *extra).startswith(needle)


def test_parser_errors_are_one_line_with_the_nearest_name(tmp_path, capsys):
    """A type error, an unknown key or class came after 85 lines of usage; now the error alone, with the nearest
    key or class suggested. Several refusals of the parser in one test (in-process: no model loads)."""
    from sgrpo.fit import parse

    (tmp_path / "unknown.yaml").write_text("model:\n  grup_size: 8\n")
    (tmp_path / "typed.yaml").write_text('model:\n  group_size: "eight"\n')
    cases = {
        ("--model.grup_size=8",): "unrecognized arguments: --model.grup_size=8 (did you mean model.group_size?)",
        ("--config", str(tmp_path / "unknown.yaml")): "does not accept option 'grup_size' (did you mean "
        "model.group_size?)",
        ("--config", str(tmp_path / "typed.yaml")): 'Parser key "model.group_size": Expected a <class \'int\'>. '
        "Got value: eight",
        ("--model.estimator=estimators.GRPo",): "has no attribute 'GRPo' (did you mean estimators.GRPO?)",
        # an optional field, or one in a class_path block: the union dump lost the key ("Expected a <class 'float'>")
        ("--model.max_grad_norm=abc",): "model.max_grad_norm: Expected a <class 'float'> (Given value: abc)",
        ("--model.task.init_args.levels=3",): "model.task.levels: Expected a <class 'list'> (Given value: 3)",
        ("--model.rollout.init_args.max_new_tokens=abc",): "model.rollout.max_new_tokens: Problem with given "
        "class_path 'sgrpo.rollout.HFRollout': Expected a <class 'int'>. Got value: abc",
    }
    for extra, needle in cases.items():
        with pytest.raises(SystemExit) as refused:
            parse(["--config", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}", *extra])
        assert refused.value.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: invalid configuration: "), lines
        assert needle in lines[0], lines[0]


def test_a_model_folder_without_a_tokenizer_is_refused_in_one_line(model_dir, tmp_path, capsys):
    """It failed in a transformers traceback about sentencepiece, once the processes had started."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "special_tokens*"))
    line = refusal(tmp_path, model_dir, capsys, f"--model.model={bare}")
    assert line == (f"error: invalid configuration: model: {bare} has no tokenizer (tokenizer.json, "
                    "tokenizer_config.json, tokenizer.model, vocab.json, spiece.model): copy the tokenizer files of "
                    "the model it came from into it (tokenizer.save_pretrained)")  # fmt: skip


@pytest.mark.parametrize("task", ["tasks.DeepMath", "tasks.GSM8K"])
def test_a_one_row_file_without_validation_is_refused_in_one_line_naming_the_fixes(task, model_dir, tmp_path, capsys):
    """A one-row file with ``validation_size: 0`` has no validation split: a ValueError traceback from the validation
    loader once the model had loaded. Now one line naming the key and both ways out; a fit without validation
    (``trainer.limit_val_batches=0``) reads no validation split."""
    fixture = "deepmath.jsonl" if task == "tasks.DeepMath" else "gsm8k.jsonl"
    one = tmp_path / "one.jsonl"
    one.write_text((REPO / "tests" / "fixtures" / fixture).read_text().splitlines()[0] + "\n")
    line = refusal(tmp_path, model_dir, capsys, f"--model.task={task}", f"--model.task.init_args.path={one}",
                   "--model.task.init_args.validation_size=0")  # fmt: skip
    assert line == (
        f"error: invalid configuration: model.task (validation split): '{one}' has no 'validation' split (it "
        "has ['train']) and validation_size is 0: set validation_size to hold out rows of train, or use a source "
        "with that split, or fit without it: --trainer.limit_val_batches=0"
    )
    from sgrpo.run.preflight import needed_splits

    assert needed_splits("fit", {"limit_val_batches": 0}) == {"train": ""}
    assert needed_splits("validate", {}) == {"validation": ""} and needed_splits("test", {}) == {"test": ""}
