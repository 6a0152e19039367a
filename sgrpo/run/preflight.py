"""Checks at parse time, before anything large loads: each error is one line naming the key and the fix.

``check_config_files`` runs on the command line (a missing or empty ``--config``), ``check_values`` on
the parsed values (steps, checkpoint path, GPUs, trainer keys sgrpo does its own way), ``check_policy`` on
the policy built from them (the model, optimizer and scheduler arguments, hub datasets), ``check_splits`` on the
task splits the command reads, and
``sgrpo.run.precision.check_weight_precision`` on the precision the trainer resolved; nothing has loaded
yet. A hub id must be in the local cache or the hub reachable: without hub access the error names the model
or dataset, instead of retries and an error about something else once loading starts.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from sgrpo.checks import ConfigError
from sgrpo.model.loading import resolve_model_path
from sgrpo.model.lora import lora_problem
from sgrpo.run.checkpoints import EXPORT_MARK
from sgrpo.run.data import stopping_rule_error
from sgrpo.run.precision import SCHEDULE_STEPS_READ, stand_in_optimizer
from tasks.data import SplitTable

_URL = re.compile(r"[a-zA-Z][\w+.-]*://")
_CPU_FIX = (
    "to try sgrpo on CPU run `make quickstart` or configs/tiny.yaml, or override --trainer.accelerator=cpu "
    "--trainer.devices=1 --trainer.strategy=auto --trainer.precision=32-true"
)


def check_config_files(args: list[str]) -> None:
    """Each ``--config``/``-c`` file of ``args`` exists and holds a YAML mapping."""
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if arg in ("--config", "-c") and i + 1 < len(args):
            value = args[i + 1]
        if value is None or value.lstrip().startswith("{"):  # an inline config, not a file
            continue
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"--config {value}: no such file")
        if not isinstance(read_yaml(path, value), dict):
            raise ConfigError(f"--config {value} is empty or not a YAML mapping; start from configs/tiny.yaml")


def read_yaml(path: Path, name: str) -> Any:
    """The YAML document of ``path``; a file that is not UTF-8 or not YAML fails in one line naming it (``name``),
    the line and the column."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {name}: not UTF-8 text (offset {err.start}); re-save it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        opened = f", {context} opened on line {start.line + 1}" if context and start is not None else ""
        raise ConfigError(f"--config {where}: not valid YAML ({problem}{opened}); fix the file there") from None


def check_values(config: Any) -> None:
    """Steps, checkpoint path and devices of a parsed configuration."""
    error = stopping_rule_error(config.trainer.max_steps, config.trainer.get("max_epochs"))
    if error is not None:
        raise ConfigError(error)
    check_checkpoint_path(config.ckpt_path)
    check_devices(config.trainer.accelerator, config.trainer.devices)
    check_trainer_keys(config.trainer)


#: trainer keys of automatic optimisation, which the policy does itself: the key that does it in sgrpo
_OWN_KEYS = {
    "gradient_clip_val": "model.max_grad_norm",
    "accumulate_grad_batches": "model.micro_batch_size or micro_batch_tokens (the rows of a step are accumulated "
    "micro-batch by micro-batch) and model.num_minibatches (optimiser steps per training step)",
}


def check_trainer_keys(trainer: Any) -> None:
    """Trainer keys that Lightning refuses for a policy that optimises itself, and validation intervals that
    are not step counts, named here in one line instead of in Lightning's traceback."""
    for key, ours in _OWN_KEYS.items():
        value = trainer.get(key)
        if value is not None and not (key == "accumulate_grad_batches" and value == 1):
            raise ConfigError(f"trainer.{key} is not for sgrpo, which steps the optimiser itself: use {ours}")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:  # a ZeroDivisionError, later
        raise ConfigError(
            f"trainer.val_check_interval must be >= 1 training steps, got {interval} (to validate only at the end, "
            f"set it to trainer.max_steps)"
        )
    if isinstance(interval, float):  # Lightning reads a float as a fraction of an epoch
        raise ConfigError(
            f"trainer.val_check_interval must count training steps (an integer, counted across epochs; not a fraction "
            f"of an epoch), got {interval}"
        )
    limit, epochs = trainer.get("limit_train_batches"), trainer.get("max_epochs") not in (None, -1)
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit == 0:
        raise ConfigError("trainer.limit_train_batches=0 trains no step (and would export the untrained model): to "
                          "evaluate a model, run python -m sgrpo.fit validate")  # fmt: skip
    if isinstance(limit, float) and limit != 1.0 and not epochs:  # Lightning's error, once the model has loaded
        raise ConfigError(f"trainer.limit_train_batches={limit} is a fraction of an epoch, which a run bounded by "
                          "trainer.max_steps does not have: give the steps an epoch as an integer, or bound the run "
                          "by trainer.max_epochs")  # fmt: skip


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """``--ckpt_path``: "last", or a local checkpoint that exists; never a URL."""
    if ckpt_path is None or ckpt_path == "last":
        return
    if _URL.match(ckpt_path):
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: remote checkpoints are refused (Lightning unpickles them with "
            f"weights_only=False, which runs whatever code they hold); download it, check it, pass the local path"
        )
    if not Path(ckpt_path).expanduser().exists():
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such checkpoint; give 'last' or an existing .ckpt")
    from sgrpo.run.checkpoints import checkpoint_problem

    problem = checkpoint_problem(Path(ckpt_path).expanduser())  # opened memory-mapped: cheap
    if problem:
        raise ConfigError(f"--ckpt_path {ckpt_path} does not load ({problem}); give 'last' or a checkpoint a run wrote")


def writable(root: Path) -> bool:
    """Whether ``check_writable(root)`` passes."""
    try:
        check_writable(root)
    except ConfigError:
        return False
    return True


def check_export_dir(export_dir: str | None, root: Path) -> None:
    """``model.export_dir``, which a fit's end replaces whole, is refused before any model loads where that deletes
    what is not an export: a file, a folder holding files but no ``EXPORT_MARK`` (the base model's folder, another
    model, a user's data), the run folder or a folder holding it (its checkpoints and metrics went with it); and
    where it cannot be written."""
    if export_dir is None:
        return
    path, run, key = Path(export_dir).expanduser().absolute(), Path(root).expanduser().absolute(), "model.export_dir"
    if path == run or path in run.parents:
        raise ConfigError(f"{key}={export_dir} is the run folder or holds it, and the export replaces it whole "
                          "(the checkpoints with it): give a folder of its own (default: <run folder>/hf_model)")
    if path.is_file() or (path.is_dir() and any(path.iterdir()) and not (path / EXPORT_MARK).is_file()):
        raise ConfigError(f"{key}={export_dir} holds what is not a fit's export (no {EXPORT_MARK}), and the export "
                          f"replaces it whole: give a new or empty folder, or remove this one")  # fmt: skip
    check_writable(path, key)


def check_writable(root: Path, key: str = "trainer.default_root_dir") -> None:
    """The run folder ``trainer.default_root_dir`` (or the folder of ``key``) can be written: an entry is created
    (and removed) in it, or in the nearest folder above it that exists (a fit creates the rest). Probed by writing, as
    ``os.access`` answers yes to root on a read-only mount or an immutable folder."""
    folder = Path(root).expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(folder))
        os.rmdir(tempfile.mkdtemp(prefix=".sgrpo-probe-", dir=folder))
    except OSError as err:
        raise ConfigError(
            f"{key}={root}: cannot write in {folder} ({err.strerror or err}); give a folder "
            f"this user can write"
        ) from None


def check_devices(accelerator: Any, devices: Any) -> None:
    """A GPU config on a machine with fewer GPUs fails here, in one line, not in Lightning's traceback."""
    if not isinstance(accelerator, str) or accelerator.lower() not in ("gpu", "cuda"):
        return
    wanted = _count(devices)
    found = torch.cuda.device_count()
    if found < wanted:
        raise ConfigError(
            f"this config asks for {wanted} GPU(s) (trainer.accelerator={accelerator}, trainer.devices={devices}) "
            f"and this machine has {found}; {_CPU_FIX}"
        )


def _count(devices: Any) -> int:
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() and int(text) > 0 else 1  # "auto" and -1: at least one


#: the files of a tokenizer, one of which a model folder must hold
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_model(model: str) -> None:
    """``model``: a local folder with a config.json, or a hub id that is cached or reachable."""
    path = Path(resolve_model_path(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model: {path} has no config.json; give a folder written by save_pretrained")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):  # else a transformers traceback
            raise ConfigError(f"model: {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the tokenizer "
                              "files of the model it came from into it (tokenizer.save_pretrained)")  # fmt: skip
        return
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ConfigError(f"model: {model} does not exist; give a local model folder or a hub id such as 'owner/name'")
    check_hub(model, "model", "model")


def check_hub(repo_id: str, kind: str, key: str) -> None:
    """A hub id of ``kind`` ("model" or "dataset") must be in the local cache, or the hub must answer for it."""
    if _cached(repo_id, kind):
        return
    fix = "give a local path instead, or download it where the hub is reachable"
    missing = f"{key}: {kind} {repo_id!r} is not in the local cache and the hub"
    if _offline():
        raise ConfigError(f"{missing} is off (offline mode); {fix}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, repo_type=kind, timeout=10)
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: no {kind} {repo_id!r} on the hub (a private one needs `hf auth login`)") from None
    except Exception as err:  # no network, a proxy, a timeout: say which id could not be reached
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ConfigError(f"{missing} cannot be reached ({reason}); {fix}") from None


def _offline() -> bool:
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE") for name in names)


def _cached(repo_id: str, kind: str) -> bool:
    from huggingface_hub import constants, snapshot_download

    try:
        snapshot_download(repo_id, repo_type=kind, local_files_only=True)
        return True
    except Exception:  # not in the hub cache (or an unusable one): the datasets cache may still hold it
        pass
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets")
    return kind == "dataset" and (datasets_cache / repo_id.replace("/", "___")).is_dir()


def check_policy(policy: Any, max_steps: int | None = None, mode: str = "fit") -> None:
    """The model exists, the optimizer and scheduler build (on a stand-in parameter), the hub datasets are there.
    With ``max_steps`` (a fit's), the scheduler is stepped that many times (at most ``SCHEDULE_STEPS_READ``), once
    per training step as the fit steps it: a schedule shorter than the run (OneCycleLR's ``total_steps``) raised
    mid-run, inside an update, hours in. The rollout engines are checked where ``mode`` samples with them."""
    check_model(policy.model_path)
    check_prompt_room(policy)
    check_rollout_servers(policy, ("rollout", "val_rollout") if mode == "fit" else ("val_rollout",))
    if policy.peft is not None and (problem := lora_problem(policy.peft, policy.keep_dropout, policy.model_path)):
        raise ConfigError(problem)
    estimator = policy.estimator
    if getattr(estimator, "requires_nonnegative_rewards", False) and (why := signed_reward(policy.task.reward)):
        raise ConfigError(f"model.estimator: {type(estimator).__name__} needs rewards >= 0 (it divides by the group "
                          f"mean), but {why}: use scale '01' and weights >= 0")  # fmt: skip
    optimizer = stand_in_optimizer(policy)
    for group in optimizer.param_groups:
        lr = float(group.get("lr", 1.0))
        if not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"model.optimizer: lr must be a finite number > 0, got {lr}")
    if policy.scheduler_factory is not None:
        steps = 1 if max_steps is None or max_steps < 1 else min(max_steps, SCHEDULE_STEPS_READ)
        step = 0
        try:  # built and stepped (StepLR's step_size 0 divides by it at the first step)
            scheduler = policy.scheduler_factory(optimizer)
            optimizer.step()  # no gradient: nothing moves, and the scheduler sees its optimiser stepped first
            while step < steps:
                step += 1
                scheduler.step()
        except (TypeError, ValueError, ZeroDivisionError, IndexError) as err:
            at = f" at training step {step} of trainer.max_steps={max_steps}" if step > 1 else ""
            raise ConfigError(f"model.scheduler: {err}{at}") from None
    for table in vars(policy.task).values():
        if isinstance(table, SplitTable):
            check_table(table)


def signed_reward(reward: Any) -> str | None:
    """Why ``reward`` scores below 0 by its settings (a ±1 ``scale``; a ``WeightedSum`` weight < 0, or such a part),
    or None: a rewards >= 0 estimator (MaxRL) then raised at the first step, after the model had loaded."""
    if getattr(reward, "scale", None) == "pm1":
        return f"reward {getattr(reward, 'name', type(reward).__name__)!r} has scale 'pm1' (a wrong answer scores -1)"
    for part, weight in zip(getattr(reward, "rewards", None) or (), getattr(reward, "weights", None) or ()):
        if weight < 0:
            return f"reward {reward.name!r} weighs its part {part.name!r} by {weight}"
        if why := signed_reward(part):
            return why
    return None


def check_table(table: SplitTable) -> None:
    """A hub dataset is there; a local file or folder is read now (the task keeps its rows), so that a missing
    column, an empty file or one that is not UTF-8 or JSON fails here in one line, not in every process's
    data loader after the model has loaded."""
    key = f"model.task.init_args.{table.field}"
    if table.kind == "hub":
        check_hub(table.path, "dataset", key)
        return
    try:
        table.splits()
    except (ValueError, OSError) as err:  # the data layer's messages name the file, the line and the column
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None


def needed_splits(mode: str, trainer: Any) -> dict[str, str]:
    """The task splits a command reads (``mode``: "fit", "validate" or "test"; ``trainer``: its settings), each
    with the way to do without it ("" if there is none): a fit reads train, and validation unless
    ``trainer.limit_val_batches`` is 0 (Lightning then runs no validation loop)."""
    if mode != "fit":
        return {} if trainer.get(f"limit_{'val' if mode == 'validate' else 'test'}_batches", 1.0) == 0 else {
            "validation" if mode == "validate" else "test": ""}  # fmt: skip
    without = {} if trainer.get("limit_val_batches", 1.0) == 0 else {"validation": "--trainer.limit_val_batches=0"}
    return {"train": "", **without}


def check_splits(task: Any, needed: dict[str, str]) -> None:
    """Each split in ``needed`` (``needed_splits``) exists and holds examples, for a task that reads only local files
    (already read by ``check_table``; a hub dataset is not downloaded here) or makes its examples in memory
    (``Task.generated``; there an empty split is refused where the command cannot do without it: a fit's train
    split, the split ``validate`` or ``test`` reads): a one-row file with ``validation_size: 0``, or ``num_train: 0``,
    fails now in one line naming the key and the fixes, not in a loader after the model has loaded (or, for
    ``validate``, in an evaluation of nothing that printed no table)."""
    tables = [t for t in vars(task).values() if isinstance(t, SplitTable)]
    generated = getattr(task, "generated", False)
    if not generated and (not tables or any(t.kind == "hub" for t in tables)):
        return
    for split, without in needed.items():
        other = f", or fit without it: {without}" if without else ""
        try:
            examples = task.examples(split)
        except ValueError as err:
            raise ConfigError(f"model.task ({split} split): {str(err).splitlines()[0]}{other}") from None
        if generated and len(examples) == 0 and not without:  # an empty validation split only skips a fit's checks
            raise ConfigError(f"model.task ({split} split): {type(task).__name__} makes no {split} examples: give "
                              f"model.task.init_args.num_{split} a count >= 1")  # fmt: skip


def check_prompt_room(policy: Any) -> None:
    """``max_prompt_tokens`` and each rollout engine's ``max_new_tokens`` fit in the engine's own limit (vLLM's
    ``max_model_len``) and in the model's positions (read from its config.json, where it is at hand)."""
    from sgrpo.rollout.prompt_limits import prompt_room

    positions = configured_positions(policy.model_path)
    for key in ("rollout", "val_rollout"):
        engine = getattr(policy, key)
        prompt_room(positions, engine.max_total_tokens, policy.max_prompt_tokens, engine.max_new_tokens, key)


def check_rollout_servers(policy: Any, keys: tuple[str, ...] = ("rollout", "val_rollout")) -> None:
    """Rollout engines on servers (``VLLMServerRollout``) reach them now, and ``VLLMRollout`` finds vLLM: a server
    that is not up, a launcher without its interpreter or vLLM not installed fails here in one line naming the key,
    before the model loads (``keys``: the engines the command samples with; validate and test, the validation's)."""
    for key in keys:
        preflight = getattr(getattr(policy, key), "preflight", None)
        error = preflight() if callable(preflight) else None
        if error:
            raise ConfigError(f"model.{key}: {error}")


def configured_positions(model: str) -> int | None:
    """``max_position_embeddings`` of a local model folder's config.json or a hub model's cached one, else None."""
    path = Path(resolve_model_path(model)) / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        positions = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):  # unreadable: loading will say so
        return None
    return positions if isinstance(positions, int) else None
