"""``python -m sgrpo.fit validate|test``: evaluate a checkpoint (``--ckpt_path``) or a model folder (``--model.model``).

``evaluate`` runs Lightning's ``validate`` or ``test`` on the policy the CLI built and prints its accuracy by
difficulty; ``evaluated_checkpoint`` refuses, in one line and before anything runs, a checkpoint that is missing,
broken, sharded under a strategy that cannot read it, or trained with other LoRA settings than the config's. A
checkpoint whose weights do not fit ``model.model`` (other shapes, other keys) is refused in one line too, as it
fails to load (``FailFast`` tells that error from the others).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from sgrpo.eval.evaluation import evaluation_table
from sgrpo.export import CheckpointError, open_checkpoint, recorded_policy
from sgrpo.model.loading import resolve_model_path
from sgrpo.model.lora import peft_mismatch
from sgrpo.run.checkpoints import evaluation_load_failure
from sgrpo.run.faults import FailFast
from sgrpo.run.folders import latest_checkpoint


def evaluate(cli, mode: str) -> None:
    """``validate`` or ``test`` the policy of ``--ckpt_path`` (a path or ``last``), else of ``model.model``, and
    print its accuracy by difficulty. Writes no checkpoint, export or metrics file; the logger logs as usual."""
    trainer, policy = cli.trainer, cli.model
    ckpt_path = evaluated_checkpoint(cli.config.ckpt_path, trainer, policy)
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
    return ckpt_path
