"""GRPOPolicy: the LightningModule that samples groups, scores them, estimates advantages and updates."""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from estimators import AdvantageEstimator
from sgrpo.checks import ConfigError, require
from sgrpo.distributed import data_parallel_rank, data_parallel_size, is_sharded
from sgrpo.eval.evaluation import PolicyEvaluation
from sgrpo.export import PolicyExport
from sgrpo.model.lora import LoRA, is_adapter
from sgrpo.policy_model import PolicyModel
from sgrpo.rollout.engine import RolloutEngine, bump_weights_version
from sgrpo.rollout.hf import HFRollout
from sgrpo.rollout.vllm_server import shared_servers_error
from sgrpo.run.data import EpochStepBatches, PromptBatch, RefillStream, StepBatches, prompt_collate, stopping_rule_error
from sgrpo.run.guards import DivergenceWatch, RewardFailureWatch, guard_state, restore_guards
from sgrpo.train.asynchronous import AsyncRollouts, async_rollout_error, unused_async_settings
from sgrpo.train.collect import GroupCollection
from sgrpo.train.exchange import balance_error, balance_mode
from sgrpo.train.loss import ClippedSurrogate, PolicyLoss
from sgrpo.train.step_logging import StepLogging
from sgrpo.train.update import PolicyUpdate
from sgrpo.types import Example
from tasks.base import Task
from tasks.environment import Environment


class GRPOPolicy(
    AsyncRollouts, GroupCollection, PolicyEvaluation, PolicyExport, PolicyModel, PolicyUpdate, StepLogging,
    LightningModule,
):
    """Group-relative policy optimisation with a pluggable advantage estimator (manual optimisation).

    One training step: ``prompts_per_step`` prompts (global, split across processes) -> ``group_size``
    completions each -> rewards ``[B, G]`` -> ``estimator`` -> clipped-surrogate updates, reusing the
    rollout for ``ppo_epochs`` x ``num_minibatches`` optimiser steps. The loss aggregation is a
    loss setting (docs/policy_loss.md §7.4), so two runs can differ in the estimator alone.
    ``trainer.max_steps`` counts training steps (rollout batches). Rollout sampling is seeded from
    ``(seed, step, rank)``, so a resumed run reproduces an uninterrupted one. Micro-batches accumulate
    with the global batch's denominators, so their split changes memory and speed, not the update.

    The trained policy is the sampling policy: dropout is off unless ``keep_dropout``, the rollout's LM
    head is the loss's (``sgrpo.model.head``, float32, with the model's own logit transform; a model whose
    forward does something else to its logits is refused at load), and a rollout engine that truncates
    the distribution by top-k or ``min_new_tokens`` is refused for training (top-p is allowed, as in verl:
    the loss's log-probs stay the full softmax's; ``train/rollout/nucleus_mass``). The LR scheduler steps
    once per training step; the gradient norm is taken and clipped after mixed precision's loss scale
    is removed.
    """


    def __init__(
        self,
        model: str,
        task: Task,
        estimator: AdvantageEstimator,
        rollout: RolloutEngine | None = None,
        val_rollout: RolloutEngine | None = None,
        group_size: int = 8,
        prompts_per_step: int = 8,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | Literal["auto"] | None = "auto",
        loss: PolicyLoss | None = None,
        mask_truncated: bool = False,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        log_completions_every: int = 50,
        log_completions_groups: int = 2,
        log_mgf_temperature: float | None = None,
        max_grad_norm: float | None = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        val_samples: int = 4,
        val_greedy: bool = False,
        val_reward: bool = False,
        val_prompts_per_batch: int = 32,
        logits_chunk_mib: float = 128.0,
        share_prompts: bool = True,
        packing: bool = True,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        lean_mlp: bool = True,
        lean_norm: bool = True,
        gradient_sync: Literal["auto", "step", "micro_batch"] = "auto",
        keep_dropout: bool = False,
        peft: LoRA | None = None,
        seed: int = 0,
        export_dir: str | None = None,
        max_prompt_tokens: int | None = None,
        reward_failure_share: float = 1.0,
        reward_failure_steps: int = 3,
        max_nonfinite_steps: int = 3,
        environment: Environment | None = None,
        async_rollout: bool = False,
        max_staleness: int = 1,
        producer_timeout: float = 600.0,
        sync_every: int = 1,
        balance_batch: bool | Literal["rows", "groups"] | None = None,
    ) -> None:
        """The config's ``model:`` block.

        Args:
            model: Hugging Face hub id or local folder of a causal LM.
            task: Prompts, rewards and success (``tasks.Task``).
            estimator: Advantages from a group's rewards (``estimators.AdvantageEstimator``).
            rollout: Sampling engine for training (default ``HFRollout()``).
            val_rollout: Sampling engine for validation; may truncate (top-k, top-p). Default: ``rollout``.
            group_size: Completions per prompt (TRL ``num_generations``, verl ``rollout.n``).
            prompts_per_step: Prompts per training step, over all processes.
            ppo_epochs: Passes over each rollout batch (TRL ``num_iterations``).
            num_minibatches: Optimiser steps per pass; each takes 1/num_minibatches of the rows.
            micro_batch_size: Rows per forward/backward (null: no row limit).
            micro_batch_tokens: A forward/backward's budget: with ``packing``, its modelled cost (each sequence's
                tokens plus attention's ``L^2 / 6H``: docs/packing.md), else its padded tokens; "auto": 1,024 on
                CPU, 8,192 on accelerators.
            loss: The policy loss (default ``ClippedSurrogate()``: clip, aggregation, KL, importance sampling).
            mask_truncated: Completions cut off at ``max_new_tokens`` get no gradient (DAPO's overlong filter).
            dynamic_sampling: Drop groups whose rewards are all equal and sample more prompts (DAPO).
            max_sampling_rounds: Sampling rounds per step at most, with dynamic sampling.
            log_completions_every: Write a few groups' completions every N steps (0: never).
            log_completions_groups: Groups written each time.
            log_mgf_temperature: Log ``train/log_mgf``, the mean over groups of tau log mean_j exp(r_j / tau), at
                this tau (reward units); null: at a SoftmaxGRPO estimator's own tau(s), nothing for the others.
            max_grad_norm: Clip the gradient norm to this (null: no clipping).
            optimizer: Optimiser class and arguments (lr, weight_decay, ...).
            scheduler: LR scheduler class and arguments; stepped once per training step.
            val_samples: Completions per validation prompt (pass@k up to this k).
            val_greedy: Validate with greedy decoding (one completion per prompt, whatever ``val_samples`` says).
            val_reward: Also log the mean training reward of the validation completions (``val/reward``).
            val_prompts_per_batch: Validation prompts per rollout call.
            logits_chunk_mib: Memory bound of one chunk of float32 logits in the loss.
            share_prompts: Run each distinct prompt once per micro-batch (packed: under a block mask where it pays;
                padded: on a KV cache, off under FSDP2).
            packing: Log-probs of each micro-batch's real tokens packed in rows, no padding (checked at start).
            dtype: Weights' dtype at load ("float32" keeps float32 master weights under bf16-mixed).
            activation_checkpointing: Recompute activations in the backward (less memory, ~1/3 more compute).
            lean_mlp: A SwiGLU MLP's backward recomputes silu(gate) * up (``sgrpo.model.lean_mlp``): the same
                gradients, about a third less activation memory per layer.
            lean_norm: An RMSNorm's backward recomputes its normalised input (``sgrpo.model.lean_norm``): the same
                gradients, 4 bytes less activation memory per norm, token and hidden unit.
            gradient_sync: FSDP2 reduces gradients per optimiser "step" or "micro_batch"; "auto": "step" where it fits.
            keep_dropout: Keep the model's dropout in training (off by default: the trained policy is the sampled one).
            peft: LoRA adapters (``sgrpo.model.lora.LoRA``); null trains every weight.
            seed: Seed of rollout sampling and data order, mixed with step and rank.
            export_dir: Where fit's end writes the trained model (default ``<run folder>/hf_model``).
            max_prompt_tokens: Longer prompts are dropped at read (default: positions less max_new_tokens).
            reward_failure_share: Share of a step's rewards that failed, at or above which the step counts as failed.
            reward_failure_steps: Failed steps in a row that stop the run.
            max_nonfinite_steps: Optimiser steps in a row with a non-finite loss or gradient (each skipped) that stop
                the run (docs/runs.md, "A diverged run").
            environment: Multi-turn episodes (``tasks.environment.Environment``, docs/environments.md); null: one
                completion per sample.
            async_rollout: Sample in a producer process that runs ahead of the trainer (docs/async.md); HFRollout or
                VLLMServerRollout.
            max_staleness: With async_rollout, versions (training steps) a trained group may lag the trainer, >= 0.
            producer_timeout: Seconds the trainer waits for the producer's next groups (or, at a push, for the
                weights' lock) before it raises (a hang).
            sync_every: With async_rollout, training steps between weight pushes to the producer, <= max_staleness + 1.
            balance_batch: Move a step's rows between processes before the update so each trains an even share
                (docs/packing.md): null/false each process its own rows; "rows" (or true) verl's placement of
                single rows; "groups" whole groups by the packed cost model.
        """

        super().__init__()
        require(group_size >= 2, f"group_size must be >= 2 to compare completions, got {group_size}")
        require(prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {prompts_per_step}")
        require(ppo_epochs >= 1 and num_minibatches >= 1, "ppo_epochs and num_minibatches must be >= 1")
        require(micro_batch_size is None or micro_batch_size >= 1, "micro_batch_size must be >= 1 or null")
        require(
            micro_batch_tokens in (None, "auto") or (isinstance(micro_batch_tokens, int) and micro_batch_tokens >= 1),
            f"micro_batch_tokens must be >= 1, 'auto' or null, got {micro_batch_tokens!r}",
        )
        require(max_grad_norm is None or max_grad_norm > 0, "max_grad_norm must be > 0 or null")
        require(val_samples >= 1 and val_prompts_per_batch >= 1, f"val_samples and val_prompts_per_batch must be >= 1, "
                f"got {val_samples} and {val_prompts_per_batch}")  # fmt: skip
        require(dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32/bfloat16/float16, got {dtype}")
        require(max_prompt_tokens is None or max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1 or null")
        error = async_rollout_error(async_rollout, max_staleness, rollout or HFRollout(), sync_every, environment)
        require(error is None, error)
        require(producer_timeout > 0, f"model.producer_timeout must be > 0 seconds, got {producer_timeout}")
        if unused := unused_async_settings(async_rollout, max_staleness, producer_timeout):
            rank_zero_warn(unused)
        self.async_rollout, self.max_staleness, self.producer_timeout = async_rollout, max_staleness, producer_timeout
        self.sync_every = sync_every
        self.balance_batch = balance_mode(balance_batch)  # sgrpo.train.exchange; refused in one line
        require(balance_error(self.balance_batch, environment) is None, balance_error(self.balance_batch, environment))
        self.reward_watch = RewardFailureWatch(reward_failure_share, reward_failure_steps)
        self.divergence_watch = DivergenceWatch(max_nonfinite_steps)
        self.max_prompt_tokens, self.prompts_dropped = max_prompt_tokens, 0
        self.automatic_optimization = False
        self.model_path = model
        self.task = task
        self.estimator = estimator
        self.rollout = rollout if rollout is not None else HFRollout()
        truncation = self.rollout.truncation()
        require(
            truncation is None,
            f"rollout samples with {truncation}, a truncated distribution, but the loss's log-probs are those of "
            "the full softmax(logits / temperature), so every importance ratio would be off: train with top_k 0 "
            "and min_new_tokens 0 (top_p is allowed), and give truncated sampling to val_rollout for evaluation",
        )
        self.val_rollout = val_rollout if val_rollout is not None else self.rollout
        require((shared := shared_servers_error(self.rollout, self.val_rollout)) is None, shared or "")
        self.environment = environment
        for key in ("rollout", "val_rollout") if environment is not None else ():
            engine = getattr(self, key)
            tp = getattr(engine, "tensor_parallel_size", 1)
            require(engine.runs_episodes, f"model.{key}: {type(engine).__name__}"
                    f"{f' with tensor_parallel_size {tp}' if tp > 1 else ''} does not run multi-turn episodes, which "
                    "model.environment needs: use sgrpo.rollout.HFRollout, sgrpo.rollout.VLLMServerRollout or "
                    "sgrpo.rollout.VLLMRollout with tensor_parallel_size 1, or environment: null")  # fmt: skip
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.ppo_epochs, self.num_minibatches, self.micro_batch_size = ppo_epochs, num_minibatches, micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.loss = loss if loss is not None else ClippedSurrogate()
        require(max_sampling_rounds >= 1, f"max_sampling_rounds must be >= 1, got {max_sampling_rounds}")
        self.mask_truncated, self.dynamic_sampling = mask_truncated, dynamic_sampling
        self.max_sampling_rounds = max_sampling_rounds
        require(log_completions_every >= 0, "log_completions_every must be >= 0 (0: off)")
        require(log_completions_groups >= 1, f"log_completions_groups must be >= 1 (log_completions_every: 0 turns the "
                f"log off), got {log_completions_groups}")  # fmt: skip
        require(0 < logits_chunk_mib < float("inf"), f"logits_chunk_mib must be a finite number of MiB > 0, got "
                f"{logits_chunk_mib}")  # fmt: skip
        self.log_completions_every, self.log_completions_groups = log_completions_every, log_completions_groups
        require(
            log_mgf_temperature is None or (0 < log_mgf_temperature < float("inf")),
            f"log_mgf_temperature must be finite and > 0 (reward units) or null, got {log_mgf_temperature}",
        )
        self.log_mgf_temperature = log_mgf_temperature
        self._refill: RefillStream | None = None  # more prompts for dynamic sampling, ones the step has not drawn
        self.max_grad_norm = max_grad_norm
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.val_greedy, self.val_prompts_per_batch = val_greedy, val_prompts_per_batch
        self.val_samples = 1 if val_greedy else val_samples  # greedy: argmax copies were decoded and logged as pass@k
        self.val_reward = val_reward
        self.logits_chunk_mib, self.model_dtype, self.seed = logits_chunk_mib, dtype, seed
        self.share_prompts, self.packing = share_prompts, packing
        self.export_dir, self.activation_checkpointing = export_dir, activation_checkpointing
        self.lean_mlp, self.lean_norm = lean_mlp, lean_norm
        require(gradient_sync in ("auto", "step", "micro_batch"), "gradient_sync must be auto, step or micro_batch")
        self.gradient_sync, self.defer_gradient_sync = gradient_sync, False  # decided once sharded (configure_model)
        self.keep_dropout, self.peft = keep_dropout, peft
        self.strict_loading = peft is None  # LoRA checkpoints hold the adapters; the base is the model folder
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._screened = {}  # split -> its prompts within the limit (sgrpo.policy_model)
        self.rollout_step = 0  # training steps done; saved in checkpoints, drives data position and seeds
        self.val_history: list[dict[str, Any]] = []
        self.last_evaluation: dict[str, Any] | None = None  # the latest validation or test (sgrpo.eval.evaluation)
        self._evaluation_metrics, self._evaluation_rows = {}, []  # built with the loader (sgrpo.eval.evaluation)
        self.__dict__["_reference"] = None  # frozen KL reference: kept out of state_dict and DDP
        self._grad_norm: Tensor | None = None  # set by on_before_optimizer_step

    # ------------------------------------------------------------------ setup
    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.model.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer)}}

    def setup(self, stage: str) -> None:
        """Checks that need the processes (they exist now) but not the model (it loads after this hook)."""
        if stage != "fit":
            return
        error = stopping_rule_error(self.trainer.max_steps, self.trainer.max_epochs)
        if error is not None:
            raise ConfigError(error)
        processes = data_parallel_size(self.trainer.strategy)
        if self.prompts_per_step % processes:
            raise ConfigError(
                f"model.prompts_per_step ({self.prompts_per_step}) must divide evenly over the {processes} "
                f"data-parallel processes"
            )

    def on_train_start(self) -> None:
        self.drop_stale_completions()
        if self.async_rollout:  # at the restored step and weights: its version is rollout_step
            last = self.trainer.max_steps
            if last in (None, -1):
                last = self.trainer.max_epochs * self._stream.steps_per_epoch
            self.start_producer(self._stream, self.rollout_step, last)

    def teardown(self, stage: str) -> None:
        self.stop_producer()

    def on_fit_start(self) -> None:
        if self._reference is not None and not is_sharded(self._reference):  # fully_shard placed a sharded one
            self._reference.to(self.device)

    def train_dataloader(self):
        rank, world = data_parallel_rank(self.trainer.strategy), data_parallel_size(self.trainer.strategy)
        examples, self.prompts_dropped = self._within_prompt_limit("train")
        cursor = lambda: self.rollout_step  # noqa: E731 - each epoch's iteration starts at the steps done
        if self.trainer.max_epochs not in (None, -1):  # else max_steps bounds an endless stream
            stream = EpochStepBatches(examples, self.prompts_per_step, self.seed, cursor, rank, world,
                                      self.trainer.limit_train_batches)  # fmt: skip
        else:
            stream = StepBatches(examples, self.prompts_per_step, self.seed, cursor, rank, world)
        self._refill = RefillStream(stream, self.seed)  # prompts the step has not drawn, on every process
        self._stream = stream  # the async producer reads its steps' prompts from it
        return torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=prompt_collate)

    def on_before_batch_transfer(self, batch: PromptBatch | list, dataloader_idx: int) -> list:
        # past the precision plugin's convert_input (sgrpo.run.data.PromptBatch); a loader of one's own may give lists
        return batch.items if isinstance(batch, PromptBatch) else batch

    def transfer_batch_to_device(self, batch: list[Example], device, dataloader_idx: int) -> list[Example]:
        return batch  # prompts are text; the rollout engine tokenizes them onto the model's device

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["sgrpo"] = {
            "rollout_step": self.rollout_step,
            "val_history": self.val_history,
            "policy": self.policy_record(),  # for `python -m sgrpo.export`
            "guards": guard_state(self.reward_watch, self.divergence_watch, self.rollout_step),
        }
        # LoRA: the frozen base is the model folder. FSDP2's distributed checkpoint loads every key of the
        # model, so sharded checkpoints keep the whole state
        if self.peft is not None and self.device_mesh is None and "state_dict" in checkpoint:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if is_adapter(k)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("sgrpo", {})
        self.rollout_step = state.get("rollout_step", 0)
        self.val_history = state.get("val_history", [])
        restore_guards(state.get("guards", {}), self.reward_watch, self.divergence_watch)
        if self.model is not None:  # the checkpoint's weights replace the model's: engine copies sync again
            bump_weights_version(self.model)
        # A checkpoint saved on an exception is saved mid-batch (batch "ready" but not "completed"), and
        # Lightning's restart counts that batch once more in `_batches_that_stepped`, which numbers the
        # logged steps: undo it, so the resumed run logs its next step as `rollout_step`.
        loops = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = loops.get("epoch_loop.batch_progress", {}).get("total", {})
        epoch_loop = loops.get("epoch_loop.state_dict", {})
        if progress.get("ready", 0) > progress.get("completed", 0) and "_batches_that_stepped" in epoch_loop:
            epoch_loop["_batches_that_stepped"] = self.rollout_step - 1

    # ------------------------------------------------------------------ training
    def training_step(self, examples: list[Example], batch_idx: int) -> None:
        started = time.perf_counter()
        rollout, rewards, success, parts, reward_log = self.collect(examples)  # RolloutBatch, [B, G] each
        advantages = self.estimator(rewards)  # [B, G]
        if self.log_completions_every and self.rollout_step % self.log_completions_every == 0:
            self.log_completions(rollout, rewards, success, parts, advantages)
        trained = self.informative_groups(rewards)  # [B] bool
        update_log = self.update(rollout, advantages, trained)
        self.rollout_step += 1
        self.push_weights()  # async_rollout: version rollout_step to the producer
        timing = {"rollout_s": reward_log.pop("rollout_s"), "step_s": time.perf_counter() - started}
        logs = reward_log | update_log | {"train/prompts_dropped": float(self.prompts_dropped)}
        if self._producer is not None:
            logs |= self.async_logs(rollout, self.rollout_step - 1, trained)
        self._log_step(rollout, rewards, success, advantages, logs, timing)
