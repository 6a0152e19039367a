"""``python -m sgrpo.fit [validate|test] --config X.yaml [--model.key=value ...] [--ckpt_path last]``.

A LightningCLI over ``GRPOPolicy``: the YAML's ``model`` block is the policy's signature (task, estimator
and rollout are ``class_path`` / ``init_args`` objects), ``trainer`` is Lightning's Trainer. Every key
and type is checked at parse time, and so are the values that would only fail once a model has loaded
(``sgrpo.run.preflight``). Without a subcommand it trains into the run folder ``trainer.default_root_dir``:
checkpoints in ``checkpoints/``, the metrics the report draws in ``metrics.jsonl`` (whatever the logger),
the logger's files and the resolved config in ``lightning_logs/version_N/``, the trained policy in
``hf_model/``; the folder holds one run, locked while a fit runs (``sgrpo.run.folders``). ``validate`` and
``test`` evaluate a checkpoint (``--ckpt_path``) or a model folder (``--model.model``) on that split
and print its accuracy by difficulty, without training.

Exit codes: 0 done; 1 an error (a reward that keeps failing, a diverged run: one line); 2 a configuration, run folder or
checkpoint refused before anything ran (one line); 143 after SIGTERM and 130 after Ctrl-C, once
``last.ckpt`` is saved.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import typing
import warnings
from collections.abc import Iterable
from pathlib import Path

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from sgrpo.checks import ConfigError, exit_with_error
from sgrpo.distributed import (
    deciding_alone,
    first_refusal,
    fsdp_as_fsdp2,
    join_started_processes,
    released_after,
)
from sgrpo.eval.metrics_file import MarkResume, MetricsFile
from sgrpo.evaluate import evaluate
from sgrpo.export import CheckpointError
from sgrpo.policy import GRPOPolicy
from sgrpo.run.checkpoints import AtomicCheckpointIO, resume_failure
from sgrpo.run.cli_errors import one_line_errors, union_error
from sgrpo.run.faults import FailFast, command_ended, disk_fault, disk_words
from sgrpo.run.folders import RunRefused, SignalExit, claimed_run, launches_run, run_folder
from sgrpo.run.guards import EnvironmentFailure, GuardError
from sgrpo.run.launch_checks import (
    check_episode_sharding,
    check_launch_nodes,
    check_nodes,
    check_strategy,
    check_strategy_name,
    check_tensor_parallel,
)
from sgrpo.run.precision import check_weight_precision
from sgrpo.run.preflight import (
    check_config_files,
    check_export_dir,
    check_policy,
    check_splits,
    check_values,
    check_writable,
    needed_splits,
    writable,
)
from sgrpo.run.progress import ParameterCount, StepProgressBar
from sgrpo.run.resume import experiment_record
from sgrpo.run.saving import RunCheckpoint
from sgrpo.run.signals import sigterm_without_collective
from sgrpo.run.step_end import RunFitLoop

MODES = ("fit", "validate", "test")
#: where ``validate`` and ``test`` log (their metrics.csv and config.yaml) under trainer.default_root_dir
EVALUATION_LOGS = "evaluations"
DESCRIPTION = (
    "Train a policy (the default), or evaluate one without training: `validate` or `test` as the first argument "
    "evaluates --ckpt_path (a checkpoint, or 'last': the run's newest), else the model folder --model.model, on "
    "the task's validation or test split and prints its accuracy by difficulty."
)


class SgrpoCLI(LightningCLI):
    def __init__(self, *args, mode: str = "fit", **kwargs) -> None:
        self.mode = mode  # "fit", or "validate" / "test": an evaluation, which keeps no checkpoints or metrics file
        super().__init__(*args, **kwargs)

    def _set_seed(self) -> None:
        """Lightning replaces ``seed_everything: true`` in the config by the seed it draws, another at every start;
        the experiment record keeps the setting (``true``), so a resume of such a run is the same experiment."""
        self.configured_seed = self._get(self.config, "seed_everything")
        super()._set_seed()

    def init_parser(self, **kwargs):
        return one_line_errors(super().init_parser(**kwargs))  # the error alone, not 85 lines of usage first

    def instantiate_trainer(self, **kwargs):
        """Lightning's trainer with sgrpo's checkpoints (atomic writes), metrics file, exit codes and progress bar.

        First the values that would fail only once the model has loaded (``sgrpo.run.preflight``).
        """
        check_values(self.config)
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        check_policy(self.model, config.get("max_steps") if self.mode == "fit" else None, self.mode)
        check_splits(self.model.task, needed_splits(self.mode, config))
        callbacks = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        root = run_folder(config.get("default_root_dir"))
        if self.mode == "fit":
            check_writable(root)  # before any process or model: a read-only folder fails at the lock, mid-start
            check_export_dir(self.model.export_dir, root)  # which the fit's end replaces whole
        every, keep = self._get(self.config_init, "checkpoint_every"), self._get(self.config_init, "keep_last")
        if config.get("enable_progress_bar") is not False:
            callbacks.append(StepProgressBar())
        if config.get("enable_model_summary") is not False:  # one line in place of Lightning's 14 ("FLOPs: 0")
            callbacks.append(ParameterCount())
        config["enable_model_summary"] = False
        callbacks.append(FailFast(errors=self.mode != "fit"))  # in a fit, RunCheckpoint decides about errors
        logger = config.get("logger")
        if logger in (None, True) and self.mode != "fit" and not writable(root):
            rank_zero_info(f"{root} cannot be written: this {self.mode} prints its table and logs no metrics "
                           "(--trainer.logger=CSVLogger --trainer.logger.save_dir=FOLDER logs them there)")  # fmt: skip
            logger, self.save_config_callback = False, None  # nor its config.yaml
        if logger in (None, True):  # metrics.csv written every step: a kill loses no curve
            # an evaluation logs beside the run, not in it: into a fresh folder it must not make it look like a run
            name = "lightning_logs" if self.mode == "fit" else EVALUATION_LOGS
            logger = CSVLogger(root, name=name, flush_logs_every_n_steps=1)
        loggers = [] if logger is False else list(logger) if isinstance(logger, Iterable) else [logger]
        if self.mode == "fit":
            metrics = MetricsFile(root)  # the report's metrics, whichever logger the run chose (or none)
            loggers.append(metrics)
            checkpoints = RunCheckpoint(str(root / "checkpoints"), every, keep)
            checkpoints.resume_changes = self._get(self.config, "resume_changes")
            callbacks += [checkpoints, SignalExit(), MarkResume(metrics)]
        config["logger"] = loggers or False
        check_strategy_name(config.get("strategy", "auto"))
        config["strategy"] = fsdp_as_fsdp2(config.get("strategy", "auto"))  # FSDP1 runs as FSDP2, with a notice
        trainer = self._instantiate_trainer(config, callbacks)
        sigterm_without_collective(trainer)  # Lightning's SIGTERM handler broadcast (a hang under several processes)
        check_strategy(trainer.strategy)
        check_tensor_parallel(trainer.strategy)
        check_nodes(trainer)
        check_launch_nodes(trainer, self.model)
        check_episode_sharding(trainer, self.model)
        if self.mode == "fit":
            RunFitLoop.install(trainer)  # a resume at max_steps runs the validation its checkpoint owes
            check_weight_precision(trainer.precision_plugin.precision, self.model, trainer.max_steps)
            model, seed = self._get(self.config, "model"), self.configured_seed
            checkpoints.experiment = experiment_record(model, seed, trainer.precision_plugin.precision)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # not a CheckpointIO the user chose
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        counts_before_fractions(parser)
        # the classes the policy falls back on, named for the parser: `--model.loss.init_args.kl_coef=0.05` then
        # works on a config that names no loss (without a class the parser refuses it: "PolicyLoss is abstract")
        parser.set_defaults(
            {
                "model.loss": {"class_path": "sgrpo.train.ClippedSurrogate"},
                "model.rollout": {"class_path": "sgrpo.rollout.HFRollout"},
            }
        )
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from a local checkpoint, or 'last': this run's newest checkpoint that loads",
        )
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help="delete the outputs of the run already in trainer.default_root_dir (else a fresh run refuses)",
        )
        parser.add_argument(
            "--resume_changes",
            type=typing.Literal["refuse", "allow"],
            default="refuse",
            help="a resume whose model block or seed differs from the checkpoint's: refuse (naming each change), or "
            "allow (train on with the changes applied, the optimiser's settings too)",
        )
        parser.add_argument(
            "--checkpoint_every", type=int, default=50, help="save checkpoints/stepN.ckpt every N training steps"
        )
        parser.add_argument(
            "--keep_last",
            type=int | None,
            default=3,
            help="keep the newest N stepN.ckpt (null: all); last.ckpt is always kept",
        )
        parser.add_argument(
            "--validate_before",
            type=bool,
            default=False,
            help="validate the initial policy before training (the 'before' of the report)",
        )
        parser.add_argument(
            "--validate_last",
            type=bool,
            default=False,
            help="validate after the last training step when trainer.val_check_interval did not (as verl does)",
        )
        parser.add_argument(
            "--report",
            type=bool,
            default=False,
            help="print accuracy by difficulty (first -> last validation) and save a PNG of the curves",
        )


#: Trainer arguments where an int counts batches and a float is a fraction of them
BATCH_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                "overfit_batches")  # fmt: skip


def counts_before_fractions(parser: LightningArgumentParser) -> None:
    """Parse the trainer's batch limits as Lightning declares them, ``int`` before ``float``, so that
    ``limit_val_batches: 1`` is one batch and not 1.0 (all of them).

    Lightning declares ``Optional[Union[int, float]]``, but Python's typing cache hands back an equal Union made
    earlier: Fabric's ``Optional[Union[float, int]]`` (``clip_gradients``), so the parser tried float first and
    read every count as a float. ``int | float | None`` is a fresh object, in the declared order.
    """
    for action in parser._actions:
        args = typing.get_args(getattr(action, "_typehint", None))
        limit = action.dest.removeprefix("trainer.") in BATCH_LIMITS and float in args and int in args
        if limit and args.index(float) < args.index(int):
            declared = int | float  # an X | Y union is a new object, never a cached one
            for other in (a for a in args if a not in (int, float)):
                declared = declared | other
            action._typehint = declared


def parse(args: list[str] | None = None, mode: str = "fit") -> SgrpoCLI:
    """Parse and instantiate (trainer, policy, task, estimator, rollout) without loading any model.

    Every key, type and class is checked here; a constructor's check (group_size, temperature, ...)
    exits with its message, which names the key.
    """
    try:
        check_config_files(sys.argv[1:] if args is None else args)
        return SgrpoCLI(
            GRPOPolicy,
            mode=mode,
            run=False,
            args=args,
            auto_configure_optimizers=False,
            parser_kwargs={"parser_mode": "omegaconf", "description": DESCRIPTION, "prog": "python -m sgrpo.fit"},
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "log_every_n_steps": 1,
                "num_sanity_val_steps": 0,
                "check_val_every_n_epoch": None,
                "default_root_dir": "runs/default",
            },
        )
    except (ValueError, FileNotFoundError, MisconfigurationException) as err:  # ours, a constructor's, a data
        exit_with_error(f"invalid configuration: {union_error(str(err))}", 2)  # file's, Lightning's (devices=0)


def main(args: list[str] | None = None) -> SgrpoCLI:
    """Parse, then fit or evaluate (``validate`` / ``test`` as the first argument)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_dependency_warnings()
    given = sys.argv[1:] if args is None else list(args)
    mode = given[0] if given[:1] and given[0] in MODES else "fit"
    if given[:1] == [mode]:  # the mode is no option of the parser; sys.argv keeps it, for Lightning's launcher
        args = given[1:]  # starts the other processes with sys.argv (they trained while this one validated: a hang)
    interrupt = signal.getsignal(signal.SIGINT)  # the stop at a step's end replaces it for a while
    terminate = signal.getsignal(signal.SIGTERM)  # and SIGTERM's
    cli = parse(args, mode)
    try:
        if mode == "fit":
            train(cli)
        else:
            evaluate(cli, mode)
    except KeyboardInterrupt:  # a Ctrl-C outside a fit's steps (parsing, loading, the report): no traceback
        exit_with_error("interrupted (Ctrl-C)", 128 + signal.SIGINT)
    except (RunRefused, CheckpointError) as err:
        exit_with_error(str(err), 2)
    except ConfigError as err:  # one known only once the processes exist (before any model loads)
        exit_with_error(f"invalid configuration: {err}", 2)
    except (GuardError, EnvironmentFailure) as err:  # a reward that keeps failing, a diverged run: one line
        exit_with_error(str(err), 1)
    except Exception as err:  # a full or read-only disk at run time: one line, the run's checkpoints kept
        disk = disk_fault(err)
        if disk is None:
            raise
        what, fix = disk_words(disk)
        then = "; then resume with --ckpt_path last: its newest checkpoint was left as it was" if mode == "fit" else ""
        exit_with_error(f"{what} while the run wrote into {cli.trainer.default_root_dir}: {fix} (or "
                        f"use --trainer.default_root_dir on another disk){then}", 1)  # fmt: skip
    finally:
        command_ended(cli.trainer, interrupt, terminate)  # the processes leave together (release_process_group)
    return cli


def quiet_dependency_warnings() -> None:
    """Silence warnings that do not apply to sgrpo's runs, which users could only learn to ignore."""
    # `validate`/`test` hand the parser sys.argv without the mode, knowingly
    warnings.filterwarnings("ignore", r"LightningCLI's args parameter is intended to run from within Python")
    # torch (2.13 here) deprecates the LeafSpec that Lightning's CombinedLoader builds: a line per process per run
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    # over several processes, a line per evaluation metric and one for the sampler: the evaluation gathers every
    # process's results before it computes its metrics (its "step", the weights' training steps, is every process's),
    # and counts a prompt the sampler repeats once
    warnings.filterwarnings("ignore", r"It is recommended to use `self.log\('((val|test)/|step')", PossibleUserWarning)
    warnings.filterwarnings("ignore", r"Using `DistributedSampler` with the dataloaders. During `trainer.validate")
    # a fit in epochs (trainer.max_epochs): its prompt stream runs in the training process (exact length, whatever
    # Lightning fears of worker processes) and resumes mid-epoch from the policy's step
    # (sgrpo.run.data.EpochStepBatches)
    warnings.filterwarnings("ignore", r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", r"You're resuming from a checkpoint that ended before the epoch ended")
    # Lightning's advertisement for its cloud logger, printed by every run
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("💡 Tip:")
    )


def train(cli: SgrpoCLI) -> None:
    """Claim the run folder, fit (resuming from ``--ckpt_path``), then report if asked."""
    trainer, policy, config = cli.trainer, cli.model, cli.config
    root = Path(trainer.default_root_dir)
    agree = first_refusal if join_started_processes(trainer.strategy) else None  # srun, torchrun: agree on it
    leader = launches_run(trainer)
    with deciding_alone(), claimed_run(root, config.ckpt_path, config.overwrite, leader, agree) as ckpt_path:
        if config.validate_before and ckpt_path is None:
            trainer.validate(policy, verbose=False)
        fit(trainer, policy, ckpt_path)
        if config.validate_last and last_step_unvalidated(policy):
            trainer.validate(policy, verbose=False)
        if config.report and trainer.is_global_zero:
            from sgrpo.eval.report import write_report

            write_report(policy, trainer)


def last_step_unvalidated(policy: GRPOPolicy) -> bool:
    """Whether the fit trained a step after its last validation (verl validates at the last step as well)."""
    history = policy.val_history
    return policy.rollout_step > 0 and (not history or history[-1]["step"] != policy.rollout_step)


def fit(trainer, policy: GRPOPolicy, ckpt_path: str | os.PathLike | None) -> None:
    """``trainer.fit``, exiting 143 after SIGTERM and 130 after Ctrl-C (Lightning exits 0 and 1); a checkpoint that
    does not load into this run is refused in one line (``CheckpointError``), and left as it was."""
    signal_exit = next(c for c in trainer.callbacks if isinstance(c, SignalExit))
    checkpoints = next(c for c in trainer.callbacks if isinstance(c, RunCheckpoint))
    checkpoints.resume_from = ckpt_path  # agreed over the processes before it loads
    try:
        trainer.fit(policy, ckpt_path=ckpt_path)
    except SystemExit:
        if signal_exit.status is None:
            raise
        raise SystemExit(signal_exit.status) from None
    except Exception as err:
        if checkpoints.failed_resume is err:  # nothing was written: one line, exit 2
            raise CheckpointError(resume_failure(ckpt_path, err)) from None
        raise


if __name__ == "__main__":
    released_after(main)  # only here: a caller of main() may still use a sharded model's collectives
