"""What a resume may change: the experiment a checkpoint was trained as, against the config it resumes with.

A checkpoint records its run's ``model`` block and seed, flattened to ``key: value`` lines
(``experiment_record``). A resume whose config differs in any of them (another estimator, group size, task,
reward, loss, learning rate, ...) trains another experiment into the same metrics file, so it is refused in
one line naming each change, unless the user asks for it with ``--resume_changes allow``. Allowed, every
change is applied: the policy, task and estimator are built from the new config anyway, and the optimiser's
settings, which loading the optimiser state would silently put back to the old ones (a new learning rate was
ignored), are set again from the new config (``apply_optimizer_settings``).

Outside the ``model`` block, the record holds ``trainer.precision`` (``64-true`` made the weights, and the export,
float64 mid-run) and the content of every local data file the task names and of the base model's folder
(``PATH@content``: its size and a hash of each file's first and last MiB, ``content_fingerprint``), since only the
path is in the config: another file or model under the same path is another experiment too (a LoRA run's base, its
tokenizer, a KL reference). Checkpoints written before these were recorded resume without them being compared.

Settings that change how a step is computed, not what it computes, may change freely (``OPERATIONAL``):
micro-batching, memory and logging options, wait limits, and the evaluation's own settings.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from tasks.data_files import is_hidden

#: ``model.*`` keys a resume may change without changing the experiment (prefixes match their sub-keys)
OPERATIONAL = (
    "model.micro_batch_size", "model.micro_batch_tokens", "model.logits_chunk_mib", "model.share_prompts",
    "model.activation_checkpointing", "model.lean_mlp", "model.lean_norm", "model.gradient_sync",
    "model.log_completions_every",
    "model.log_completions_groups", "model.export_dir", "model.val_rollout", "model.val_samples",
    "model.val_greedy", "model.val_prompts_per_batch", "model.reward_failure_share", "model.reward_failure_steps",
    "model.task.init_args.workers", "model.task.init_args.reward.init_args.workers",
    "model.task.init_args.verifier.init_args.workers",
    "model.rollout.init_args.gpu_memory_utilization", "model.rollout.init_args.sleep",  # memory, not samples
    "model.rollout.init_args.enforce_eager", "model.rollout.init_args.weight_chunk_mib",
    "model.rollout.init_args.weights_snapshot", "model.rollout.init_args.cuda_graphs",
    "model.optimizer.init_args.fused", "model.optimizer.init_args.foreach",  # one kernel or a dozen: the same step
    "model.val_reward", "model.log_mgf_temperature",  # what validation scores, what a step logs
    "model.producer_timeout",  # how long the trainer waits for the producer (its error says to raise it)
)


class ResumeError(Exception):
    """A checkpoint that loaded but cannot continue in this run (another optimiser, or another experiment).

    Every process raises it at the same point (the checkpoint and the config are the same on each), so over
    several processes it takes the ordinary path of a refused run (``sgrpo.run.faults.EVERY_PROCESS``): one line,
    exit 2, as on one process."""


class ProcessesDisagree(ResumeError):
    """The processes of a run would resume different checkpoints (or see different bytes at one path); the
    message is the whole line."""


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}", out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True, default=str)


#: suffix of a data file's content fingerprint in the record (``model.task.init_args.path@content``)
CONTENT = "@content"
_EDGE = 1 << 20  # the bytes hashed at each end of a data file


def content_fingerprint(path: Path, hidden: bool = False) -> str:
    """A cheap fingerprint of a file's content, or of a folder's files: size and the SHA-256 of the first and last
    MiB (whole files up to 2 MiB), not the modification time (a copy of the same data is the same experiment).
    An edit of the middle of a large file that keeps its size goes unseen; any other edit changes it. A folder's
    hidden files and folders are not read: ``hf download --local-dir`` rewrites its ``.cache/huggingface``
    bookkeeping (a time stamp) at each run, and ``.git`` changes with no file of the model. ``hidden``: read them
    too, as records before 2026-12-04 did (``same_content`` accepts those)."""
    files = [path]
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and (hidden or not is_hidden(f.relative_to(path))))
    digest, size = hashlib.sha256(), 0
    for file in files:
        with open(file, "rb") as f:
            length = f.seek(0, 2)
            f.seek(0)
            digest.update(f"{file.relative_to(path) if path.is_dir() else ''}:{length}:".encode())
            digest.update(f.read(min(length, 2 * _EDGE)))
            if length > 2 * _EDGE:
                f.seek(length - _EDGE)
                digest.update(f.read(_EDGE))
        size += length
    return f"{size} bytes, {digest.hexdigest()[:16]}"


def content_disagreement(seen: list[dict[str, str]]) -> str | None:
    """Given each process's record (``seen[rank]``), one line naming a ``KEY@content`` some process sees other
    content at than process 0, or None: that process would refuse a resume alone (the others then wait in a
    collective) or train on another model or data copy."""
    for key in sorted({k for record in seen for k in record if k.endswith(CONTENT)}):
        differ = [rank for rank, record in enumerate(seen) if record.get(key) != seen[0].get(key)]
        if differ:
            name, theirs = key.removesuffix(CONTENT), seen[differ[0]].get(key, "nothing")
            processes = f"process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))}"
            return (f"{name}: {processes} see{'s' if len(differ) == 1 else ''} other content there than process 0 "
                    f"({json.loads(theirs) if theirs != 'nothing' else theirs} against "
                    f"{json.loads(seen[0][key]) if key in seen[0] else 'nothing'}): another copy of the model or data "
                    f"on another node; make every process see the same files")  # fmt: skip
    return None


def same_content(key: str, trained: str, record: dict[str, str]) -> bool:
    """Whether a ``KEY@content`` fingerprint a checkpoint recorded (``trained``, JSON) is that of the path ``record``
    names now, also as records before 2026-12-04 fingerprinted folders (hidden files read): those checkpoints
    were refused as another model once hidden files left the fingerprint."""
    if record.get(key) == trained:
        return True
    try:
        path = Path(json.loads(record[key.removesuffix(CONTENT)])).expanduser()
        return path.is_dir() and json.dumps(content_fingerprint(path, hidden=True)) == trained
    except (KeyError, TypeError, ValueError, OSError):
        return False


def base_change(trained: dict[str, str] | None, model_path: str) -> str | None:
    """``model.model: old -> new`` where ``model_path`` holds another base model than a checkpoint's experiment
    record (``trained``) names: by content where both are local folders (a copy elsewhere is the same model), by
    name where both are hub ids; None if the same, where one is a hub id and the other a folder (a snapshot of it,
    maybe: not known here), or where the record has neither (a checkpoint from before they were recorded)."""
    if not trained or "model.model" not in trained:
        return None
    now = experiment_record({"model": model_path}, None)
    content = "model.model" + CONTENT
    if (content in trained) != (content in now):
        return None
    key = content if content in now else "model.model"
    if trained[key] == now[key] or (key == content and same_content(key, trained[key], now)):
        return None
    return f"{key}: {trained[key]} -> {now[key]}"


def _data_fingerprints(record: dict[str, str]) -> dict[str, str]:
    """``KEY@content`` for every ``model.task`` value, and ``model.model``, that names a local file or folder (a hub id
    names none): the base model's folder holds the tokenizer, LoRA's frozen base and the KL reference's weights."""
    fingerprints = {}
    for key, text in record.items():
        value = json.loads(text)
        if (key.startswith("model.task.") or key == "model.model") and isinstance(value, str) and value.strip():
            path = Path(value).expanduser()
            try:
                if path.exists():
                    fingerprints[key + CONTENT] = json.dumps(content_fingerprint(path))
            except OSError:  # unreadable: the task's own check says so
                continue
    return fingerprints


def experiment_record(model, seed, precision: str | None = None) -> dict[str, str]:
    """The parsed config's ``model`` block (a jsonargparse namespace or a dict) and seed as
    ``{"model.group_size": "8", ...}`` (values as JSON text), without the ``OPERATIONAL`` keys; with the content
    fingerprint of each local data file (``KEY@content``) and, given, ``trainer.precision``."""
    record: dict[str, str] = {}
    _flatten(model.as_dict() if hasattr(model, "as_dict") else dict(model), "model", record)
    record["seed_everything"] = json.dumps(seed, default=str)
    record = {k: v for k, v in record.items() if not k.startswith(OPERATIONAL)}
    record |= _data_fingerprints(record)
    if precision is not None:
        record["trainer.precision"] = json.dumps(str(precision))
    return record


#: ``model.*`` keys that were ``OPERATIONAL`` in earlier versions, so their checkpoints lack them
_NO_LONGER_OPERATIONAL = ("model.rollout.init_args.max_batch_rows",)


def _recorded_since(key: str) -> bool:
    """Keys that checkpoints of earlier versions did not record: not compared when the checkpoint lacks them."""
    return key.startswith(("trainer.", *_NO_LONGER_OPERATIONAL)) or key.endswith(CONTENT)


def experiment_changes(trained: dict[str, str], resumed: dict[str, str]) -> list[str]:
    """``key: old -> new`` for every key whose value differs (``unset`` where one side lacks it); a class that
    changed is one line, without its arguments. A key the checkpoint lacks whose new value is null (a setting added
    since, left off: ``model.environment``) is no change, nor is a path whose content both records fingerprint
    alike (the model or a data file named another way, or copied elsewhere: as ``base_change`` has it)."""

    def same(k: str) -> bool:
        return k in trained and same_content(k, trained[k], resumed)

    keys = [k for k in sorted(set(trained) | set(resumed))
            if trained.get(k) != resumed.get(k) and (k in trained or not _recorded_since(k))
            and (k in trained or resumed.get(k) != "null")  # a setting added since, at its off default
            and not (k.endswith(CONTENT) and same(k))
            and not (k + CONTENT in resumed and same(k + CONTENT))]  # the same content under another path  # fmt: skip
    classes = tuple(k.removesuffix("class_path") + "init_args." for k in keys if k.endswith(".class_path"))
    return [f"{k}: {trained.get(k, 'unset')} -> {resumed.get(k, 'unset')}" for k in keys if not k.startswith(classes)]


def rescheduled(changes: list[str]) -> bool:
    """Whether ``changes`` (``experiment_changes``) change the LR schedule: its class or arguments, or one added or
    removed."""
    return any(change.startswith("model.scheduler") for change in changes)


def drop_scheduler_state(checkpoint: dict, changes: list[str]) -> None:
    """A changed schedule does not load the checkpoint's scheduler state: torch's ``load_state_dict`` would put the
    old arguments back over the new ones (``apply_optimizer_settings`` restarts the new schedule instead)."""
    if rescheduled(changes):
        checkpoint["lr_schedulers"] = []


def apply_optimizer_settings(optimizers, schedulers, changes: list[str] = (), steps: int = 0) -> None:
    """Set every parameter group's settings (lr, weight decay, betas, ...) from its optimiser's ``defaults``, the
    new config's, over those the loaded state put back; a scheduler's base learning rates follow. A changed schedule
    (``rescheduled``) runs from its start, stepped ``steps`` times (once per training step done, as the update steps
    it), as a run with it from the start would stand."""
    for optimizer in optimizers:
        lr = optimizer.defaults["lr"]
        for group in optimizer.param_groups:
            group.update({k: v for k, v in optimizer.defaults.items() if k in group and k not in ("params", "lr")})
            if "initial_lr" in group and not rescheduled(changes):  # scheduled: the step's lr in the new proportion
                group["lr"], group["initial_lr"] = group["lr"] * lr / group["initial_lr"], lr
            else:  # no schedule now (one removed: its initial_lr goes), or a new one restarted below
                group.pop("initial_lr", None)
                group["lr"] = lr
    for config in schedulers:
        scheduler = getattr(config, "scheduler", config)
        if rescheduled(changes) and hasattr(scheduler, "_last_lr"):  # built for this run, its state not loaded
            for group, base, first in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler._last_lr):
                group["initial_lr"], group["lr"] = base, first
            with warnings.catch_warnings():  # "step() before optimizer.step()": no step is trained here
                warnings.simplefilter("ignore")
                for _ in range(steps):
                    scheduler.step()
        elif hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]
