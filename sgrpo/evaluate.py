"""``python -m sgrpo.fit validate|test``: evaluate a checkpoint (``--ckpt_path``) or a model folder (``--model.model``).

``evaluate`` runs Lightning's ``validate`` or ``test`` on the policy the CLI built and prints its accuracy by
difficulty; ``evaluated_checkpoint`` refuses, in one line and before anything runs, a checkpoint that is missing,
broken, sharded under a strategy that cannot read it, or trained with other LoRA settings than the config's (or,
with LoRA, on another base model; a full-weight checkpoint of another base is evaluated with a warning). A
checkpoint whose weights do not fit ``model.model`` (other shapes, other keys) is refused in one line too, as it
fails to load (``FailFast`` tells that error from the others). Over several processes, each compares the checkpoint
it resolved with process 0's before anything loads (``SameCheckpoint``).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from sgrpo.eval.evaluation import evaluation_table
from sgrpo.export import CheckpointError, open_checkpoint, recorded_policy
from sgrpo.model.loading import resolve_model_path
from sgrpo.model.lora import peft_mismatch
from sgrpo.run.checkpoints import evaluation_load_failure
from sgrpo.run.faults import FailFast
from sgrpo.run.folders import agree_checkpoint, latest_checkpoint
from sgrpo.run.resume import ProcessesDisagree, base_change
from sgrpo.run.step_end import STEP_END

log = logging.getLogger(__name__)


def evaluate(cli, mode: str) -> None:
    """``validate`` or ``test`` the policy of ``--ckpt_path`` (a path or ``last``), else of ``model.model``, and
    print its accuracy by difficulty. Writes no checkpoint, export or metrics file; the logger logs as usual."""
    trainer, policy = cli.trainer, cli.model
    ckpt_path = evaluated_checkpoint(cli.config.ckpt_path, trainer, policy)
    trainer.callbacks.append(SameCheckpoint(ckpt_path))
    watch = next(c for c in trainer.callbacks if isinstance(c, FailFast))
    with warnings.catch_warnings():  # that the callbacks which wrote the checkpoint are absent: on purpose
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
        try:
            (trainer.validate if mode == "validate" else trainer.test)(policy, ckpt_path=ckpt_path, verbose=False)
        except Exception as err:
            if watch.failed_load is err:  # one process (several end in FailFast, with the same line)
                raise CheckpointError(evaluation_load_failure(ckpt_path, err)) from None
            raise
    result = policy.last_evaluation
    if trainer.is_global_zero and result is not None:
        source = f"{ckpt_path} (step {result['step']})" if ckpt_path else resolve_model_path(policy.model_path)
        print(f"\n{result['split'].capitalize()} accuracy by difficulty: {source}")
        print(evaluation_table(result))


class SameCheckpoint(Callback):
    """Every process evaluates the bytes process 0 does. Each resolves ``--ckpt_path last`` itself (Lightning's
    launcher starts the others seconds after process 0 resolved it): a checkpoint a running fit wrote meanwhile, or
    a stale network-filesystem cache, had them validate two models (DDP: their metrics synced as one; FSDP2: each
    loading its shards from another step). Compared once the processes are connected, before anything loads
    (``agree_checkpoint``); a difference is refused on every process in one line."""

    def __init__(self, ckpt_path: str | None) -> None:
        self.ckpt_path = ckpt_path

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:
            agree_checkpoint(trainer, self.ckpt_path, action="evaluate")
        except ProcessesDisagree as err:
            raise CheckpointError(str(err)) from None


def evaluated_checkpoint(ckpt_path: str | None, trainer, policy) -> str | None:
    """The checkpoint to evaluate, refused in one line when missing, broken, sharded under a strategy that
    cannot read it, or trained with other LoRA settings (or with(out) LoRA) than the config's."""
    if ckpt_path == "last":
        hint = "give a checkpoint's path, or evaluate a model folder with --model.model"
        ckpt_path = latest_checkpoint(Path(trainer.default_root_dir) / "checkpoints", hint)
    if ckpt_path is None:
        return None
    checkpoint = open_checkpoint(Path(ckpt_path))
    if Path(ckpt_path).is_dir() and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise CheckpointError(
            f"{ckpt_path} is sharded: evaluate it with the strategy that wrote it (the run's config), or export it "
            f"(python -m sgrpo.export {ckpt_path} OUT) and evaluate OUT with --model.model=OUT"
        )
    record = recorded_policy(checkpoint)
    if record is not None and (problem := peft_mismatch(record["peft"], policy.peft)):
        raise CheckpointError(f"{ckpt_path} {problem}")
    if change := base_change((checkpoint.get(STEP_END) or {}).get("experiment"), policy.model_path):
        if policy.peft is not None:  # adapters on another base: a score of another model, exit 0
            raise CheckpointError(f"{ckpt_path} holds LoRA adapters trained on another base model than model.model "
                                  f"({change}): give the base it trained from as --model.model")  # fmt: skip
        log.warning("%s was trained from another base model than model.model (%s): its weights load over it, but "
                    "the config (tied embeddings) and the tokenizer are model.model's", ckpt_path, change)
    return ckpt_path


if __name__ == "__main__":  # the module's name invites it: say which command evaluates
    raise SystemExit("sgrpo.evaluate is not a command: evaluate with python -m sgrpo.fit validate (or test) "
                     "--config CONFIG [--ckpt_path CKPT]")  # fmt: skip
