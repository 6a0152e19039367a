"""``python -m sgrpo.fit --config X.yaml [--model.key=value ...] [--ckpt_path last]``.

A LightningCLI over ``GRPOPolicy`` with no subcommand: the YAML's ``model`` block is the policy's
signature (task, estimator and rollout are ``class_path`` / ``init_args`` objects), ``trainer`` is
Lightning's Trainer. Every key and type is checked at parse time, before any model loads. The run
folder is ``trainer.default_root_dir``: checkpoints in ``checkpoints/``, logs and the resolved
config in ``lightning_logs/version_N/``, the trained policy in ``hf_model/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from sgrpo.policy import GRPOPolicy


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint with sgrpo's defaults: ``last.ckpt`` always, a numbered one every N steps.

    With ``dirpath`` unset, checkpoints go to ``<default_root_dir>/checkpoints`` (stable across
    resumed runs, so ``--ckpt_path last`` finds them). An interrupted or crashed run (Ctrl-C, an
    exception) also saves ``last.ckpt`` at its last completed optimiser step, so nothing since the
    previous periodic checkpoint is lost. (With several optimiser steps per training step, an
    interruption inside the update saves the steps taken so far.)
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 50,
        save_top_k: int = -1,
        save_last: bool = True,
        save_on_exception: bool = True,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            every_n_train_steps=every_n_train_steps,
            save_top_k=save_top_k,
            save_last=save_last,
            save_on_exception=save_on_exception,
            filename="step{step}",
            auto_insert_metric_name=False,
        )


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled in training steps, showing reward and success rate."""

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {key.removeprefix("train/"): value for key, value in items.items()}


class SgrpoCLI(LightningCLI):
    def instantiate_trainer(self, **kwargs):
        """Lightning's trainer, with sgrpo's progress bar unless ``trainer.enable_progress_bar`` is false."""
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        if config.get("enable_progress_bar") is not False:
            callbacks.append(StepProgressBar())
        return self._instantiate_trainer(config, callbacks)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from a checkpoint file, or 'last' for <run>/checkpoints/last.ckpt",
        )
        parser.add_argument(
            "--validate_before",
            type=bool,
            default=False,
            help="validate the initial policy before training (the 'before' of the report)",
        )
        parser.add_argument(
            "--report",
            type=bool,
            default=False,
            help="print accuracy by difficulty (first -> last validation) and save a PNG of the curves",
        )


def resolve_ckpt_path(ckpt_path: str | None, root: Path) -> str | None:
    if ckpt_path != "last":
        return ckpt_path
    last = root / "checkpoints" / "last.ckpt"
    if not last.exists():
        raise FileNotFoundError(f"--ckpt_path last: no checkpoint at {last}; run without --ckpt_path to start fresh")
    return str(last)


def parse(args: list[str] | None = None) -> SgrpoCLI:
    """Parse and instantiate (trainer, policy, task, estimator, rollout) without loading any model.

    Every key, type and class is checked here; a constructor's check (group_size, temperature, ...)
    exits with its message, which names the key.
    """
    try:
        return SgrpoCLI(
            GRPOPolicy,
            run=False,
            args=args,
            auto_configure_optimizers=False,
            parser_kwargs={"parser_mode": "omegaconf"},
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "callbacks": [RunCheckpoint()],
                "log_every_n_steps": 1,
                "num_sanity_val_steps": 0,
                "check_val_every_n_epoch": None,
                "default_root_dir": "runs/default",
            },
        )
    except ValueError as err:
        print(f"error: invalid configuration: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(args: list[str] | None = None) -> SgrpoCLI:
    """Parse, then fit (resuming from ``--ckpt_path``), then report if asked."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli = parse(args)
    trainer, policy, config = cli.trainer, cli.model, cli.config
    root = Path(trainer.default_root_dir)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = str(root / "checkpoints")
    ckpt_path = resolve_ckpt_path(config.ckpt_path, root)
    if config.validate_before and ckpt_path is None:
        trainer.validate(policy, verbose=False)
    trainer.fit(policy, ckpt_path=ckpt_path)
    if config.report and trainer.is_global_zero:
        from sgrpo.report import write_report

        write_report(policy, trainer)
    return cli


if __name__ == "__main__":
    main()
