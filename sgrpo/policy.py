"""GRPOPolicy: the LightningModule that samples groups, scores them, estimates advantages and updates."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from estimators import AdvantageEstimator, budget_mass, budget_shares
from sgrpo.batching import micro_batches, trim
from sgrpo.data import StepBatches, identity_collate
from sgrpo.distributed import gradient_sync
from sgrpo.head import check_logit_head
from sgrpo.loss import (
    AGGREGATIONS,
    Aggregation,
    clipped_surrogate,
    completion_logprobs,
    gap_means,
    k3_kl,
    logprob_gap,
    merge_gaps,
    tis_weights,
    token_weights,
)
from sgrpo.metrics import accuracy_by_difficulty, pass_at_k
from sgrpo.modeling import disable_dropout, resolve_model_path, shard_model
from sgrpo.rollout import HFRollout, RolloutEngine
from sgrpo.types import Example, RolloutBatch
from tasks.base import Task


class GRPOPolicy(LightningModule):
    """Group-relative policy optimisation with a pluggable advantage estimator (manual optimisation).

    One training step: ``prompts_per_step`` prompts (global, split across processes) -> ``group_size``
    completions each -> rewards ``[B, G]`` -> ``estimator`` -> clipped-surrogate updates, reusing the
    rollout for ``ppo_epochs`` x ``num_minibatches`` optimiser steps. The loss aggregation is a
    policy setting (spec/estimators.md §2.7), so two runs can differ in the estimator alone.
    ``trainer.max_steps`` counts training steps (rollout batches). Rollout sampling is seeded from
    ``(seed, step, rank)``, so a resumed run reproduces an uninterrupted one.

    Each optimiser step's rows are cut into micro-batches of similar completion length (longest
    first), at most ``micro_batch_size`` rows and ``micro_batch_tokens`` padded tokens each ("auto":
    1,024 on CPU, where small matmuls are already efficient, 8,192 on accelerators), and
    trimmed to their longest row; gradients accumulate over them with the global batch's
    denominators, so the split changes memory and speed, not the update. With ``share_prompts``,
    each distinct prompt of a micro-batch runs once and its completions run on its KV cache
    (``sgrpo.loss.completion_hidden_states``).

    The trained policy is the sampling policy: dropout is off unless ``keep_dropout``, the rollout's LM
    head is the loss's (``sgrpo.head``, float32, with the model's own logit transform; a model whose
    forward does something else to its logits is refused at load), and a rollout engine that truncates
    the distribution (top-k, top-p, ``min_new_tokens``) is refused for training; ``val_rollout`` (by
    default the training engine) may truncate. The LR scheduler steps once per training step; the
    gradient norm is taken and clipped after mixed precision's loss scale is removed.
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
        aggregation: Aggregation = "token_mean",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        kl_coef: float = 0.0,
        mask_truncated: bool = False,
        dynamic_sampling: bool = False,
        max_grad_norm: float | None = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        val_samples: int = 4,
        val_greedy: bool = False,
        val_prompts_per_batch: int = 32,
        logits_chunk_mib: float = 128.0,
        share_prompts: bool = True,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        keep_dropout: bool = False,
        seed: int = 0,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        _require(group_size >= 2, f"group_size must be >= 2 to compare completions, got {group_size}")
        _require(prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {prompts_per_step}")
        _require(ppo_epochs >= 1 and num_minibatches >= 1, "ppo_epochs and num_minibatches must be >= 1")
        _require(micro_batch_size is None or micro_batch_size >= 1, "micro_batch_size must be >= 1 or null")
        _require(
            micro_batch_tokens in (None, "auto") or (isinstance(micro_batch_tokens, int) and micro_batch_tokens >= 1),
            f"micro_batch_tokens must be >= 1, 'auto' or null, got {micro_batch_tokens!r}",
        )
        _require(aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        _require(
            0 <= clip_low < 1 and clip_high >= 0, f"need 0 <= clip_low < 1, clip_high >= 0; got {clip_low}, {clip_high}"
        )
        _require(kl_coef >= 0, f"kl_coef must be >= 0 (0 loads no reference model), got {kl_coef}")
        _require(max_grad_norm is None or max_grad_norm > 0, "max_grad_norm must be > 0 or null")
        _require(val_samples >= 1, f"val_samples must be >= 1, got {val_samples}")
        _require(dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32/bfloat16/float16, got {dtype}")
        self.automatic_optimization = False
        self.model_path = model
        self.task = task
        self.estimator = estimator
        self.rollout = rollout if rollout is not None else HFRollout()
        truncation = self.rollout.truncation()
        _require(
            truncation is None,
            f"rollout samples with {truncation}, a truncated distribution, but the loss's log-probs are those of "
            "the full softmax(logits / temperature), so every importance ratio would be off: train with top_k 0, "
            "top_p 1.0 and min_new_tokens 0, and give truncated sampling to val_rollout for evaluation",
        )
        self.val_rollout = val_rollout if val_rollout is not None else self.rollout
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.ppo_epochs, self.num_minibatches, self.micro_batch_size = ppo_epochs, num_minibatches, micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.aggregation, self.clip_low, self.clip_high = aggregation, clip_low, clip_high
        self.kl_coef, self.mask_truncated, self.dynamic_sampling = kl_coef, mask_truncated, dynamic_sampling
        self.max_grad_norm = max_grad_norm
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.val_samples, self.val_greedy, self.val_prompts_per_batch = val_samples, val_greedy, val_prompts_per_batch
        self.logits_chunk_mib, self.model_dtype, self.seed = logits_chunk_mib, dtype, seed
        self.share_prompts = share_prompts
        self.export_dir, self.activation_checkpointing = export_dir, activation_checkpointing
        self.keep_dropout = keep_dropout
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self.rollout_step = 0  # training steps done; saved in checkpoints, drives data position and seeds
        self.val_history: list[dict[str, Any]] = []
        self._val_outputs: list[tuple[Tensor, list[object]]] = []
        self.__dict__["_reference"] = None  # frozen KL reference: kept out of state_dict and DDP
        self._grad_norm: Tensor | None = None  # set by on_before_optimizer_step


    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, self.model_dtype)
        path = resolve_model_path(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.task.adapt_to_tokenizer(self.tokenizer)  # e.g. DeepMath requires </think> if the template opens <think>
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if not self.keep_dropout:
            disable_dropout(self.model)
        check_logit_head(self.model)  # refuses a model whose logits the loss would compute wrongly
        self.model.train()
        if self.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.kl_coef > 0:
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            self.__dict__["_reference"] = reference.requires_grad_(False)
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            shard_model(self.model, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.model.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer)}}

    def on_fit_start(self) -> None:
        if self.trainer.max_steps is None or self.trainer.max_steps < 0:
            raise ValueError("set trainer.max_steps: the prompt stream is endless, steps bound the run")
        if self.prompts_per_step % self._data_parallel_size():
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must divide evenly over "
                f"{self._data_parallel_size()} data-parallel processes"
            )
        if self._reference is not None:
            self._reference.to(self.device)

    def train_dataloader(self):
        layout = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        rank, world = layout.get("rank", 0), self._data_parallel_size()
        stream = StepBatches(
            self.task.examples("train"), self.prompts_per_step, self.seed, self.rollout_step, rank, world
        )
        return torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=identity_collate)

    def val_dataloader(self):
        examples = list(self.task.examples("validation"))
        return torch.utils.data.DataLoader(examples, batch_size=self.val_prompts_per_batch, collate_fn=identity_collate)

    def transfer_batch_to_device(self, batch: list[Example], device, dataloader_idx: int) -> list[Example]:
        return batch  # prompts are text; the rollout engine tokenizes them onto the model's device

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["sgrpo"] = {"rollout_step": self.rollout_step, "val_history": self.val_history}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("sgrpo", {})
        self.rollout_step = state.get("rollout_step", 0)
        self.val_history = state.get("val_history", [])
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
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_mix(self.seed, self.rollout_step, self.global_rank))
            rollout = self.rollout.generate(self.model, self.tokenizer, examples, self.group_size)
        generated = time.perf_counter()
        rewards, success, reward_log = self.score(examples, rollout)  # [B, G], [B, G]
        advantages = self.estimator(rewards)  # [B, G]
        keep = ~_constant(rewards) if self.dynamic_sampling else torch.ones_like(rewards[:, 0], dtype=torch.bool)
        update_log = self.update(rollout, advantages, keep)
        finished = time.perf_counter()
        self.rollout_step += 1
        timing = {"rollout_s": generated - started, "step_s": finished - started}
        self._log_step(rollout, rewards, success, advantages, reward_log | update_log, timing)

    def _log_step(self, rollout, rewards, success, advantages, logs: dict[str, Tensor], timing: dict[str, float]):
        lengths = rollout.completion_mask.sum(-1).float()  # [N]
        advantages = advantages.float()
        self._log_mean(
            logs
            | {
                "train/success_rate": success.float().mean(),
                "train/advantage/mean": advantages.mean(),
                "train/advantage/abs_mean": advantages.abs().mean(),
                "train/zero_variance_groups": _constant(rewards).float().mean(),
                "train/completion/length_mean": lengths.mean(),
                "train/completion/truncated": rollout.truncated.float().mean(),
                "train/time/rollout_s": timing["rollout_s"],
                "train/time/step_s": timing["step_s"],
                "train/throughput/rollout_tok_s": lengths.sum() / max(timing["rollout_s"], 1e-9),
            },
            prog_bar=("train/reward", "train/success_rate"),
        )
        maxima = {"train/advantage/max": advantages.max(), "train/completion/length_max": lengths.max()}
        self.log_dict(maxima, sync_dist=True, reduce_fx="max")
        self.log("train/advantage/min", advantages.min(), sync_dist=True, reduce_fx="min")
        mass = self.trainer.strategy.reduce(budget_mass(advantages, success.float().mean(-1)), reduce_op="sum")
        self.log_dict({f"train/budget/{k}": v.float() for k, v in budget_shares(mass).items()})

    def score(self, examples: list[Example], rollout: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Rewards and success flags ``[B, G]`` for a rollout, and the reward metrics to log."""
        repeated = [ex for ex in examples for _ in range(self.group_size)]
        with torch.device("cpu"):  # tasks (user code) build host tensors whatever the default device is
            result = self.task.reward.score(repeated, rollout.completions)
            success = self.task.successes(repeated, rollout.completions)
        rewards = result.total.to(self.device, torch.float32).view(len(examples), self.group_size)
        success = success.to(self.device).view_as(rewards)
        log = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(-1).mean(),
            "train/reward/failures": float(result.failures),
        }
        log |= {f"train/reward/{name}": values.float().mean() for name, values in result.parts.items()}
        return rewards, success, log

    def update(self, rollout: RolloutBatch, advantages: Tensor, keep_groups: Tensor) -> dict[str, Tensor]:
        """``ppo_epochs`` x ``num_minibatches`` optimiser steps on one rollout; returns metrics to log.

        ``advantages`` ``[B, G]``; ``keep_groups`` ``[B]`` (dynamic sampling drops the others).
        """
        token_mask = rollout.completion_mask & keep_groups.repeat_interleave(rollout.group_size).unsqueeze(-1)
        if self.mask_truncated:
            token_mask = token_mask & ~rollout.truncated.unsqueeze(-1)
        rows = token_mask.any(-1).nonzero().squeeze(-1)  # rows that carry loss
        adv_rows = advantages.reshape(-1)  # [N]
        sampler_logp = rollout.logprobs  # [N, T] the sampler's log-probs of its tokens, if it reports them
        external = sampler_logp is not None and not self.rollout.samples_from_policy  # vLLM: other weights, kernels
        old_logp = None  # on-policy single step: the current log-probs, detached, serve (no second forward)
        if external or self.ppo_epochs > 1 or self.num_minibatches > 1:
            old_logp = self._logprobs(self.model, rollout, token_mask)  # the trainer's, at the sampling weights
        is_weights, logs = None, {}
        if external and self.rollout.importance_sampling_cap is not None:
            is_weights = tis_weights(old_logp, sampler_logp, token_mask, self.rollout.importance_sampling_cap)
            logs["train/rollout/tis_weight_mean"] = is_weights.sum() / token_mask.sum().clamp_min(1)
        ref_logp = self._logprobs(self._reference, rollout, token_mask) if self.kl_coef > 0 else None
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        sums: dict[str, Tensor] = {}
        gap = None  # sampler vs trainer log-probs; on one on-policy pass, measured on that pass's own
        if sampler_logp is not None and old_logp is not None:
            gap = logprob_gap(old_logp, sampler_logp, token_mask)
        first_pass_gap = sampler_logp if old_logp is None else None
        generator = torch.Generator().manual_seed(_mix(self.seed, self.rollout_step, 1))
        started = time.perf_counter()
        for epoch in range(self.ppo_epochs):
            shuffle = torch.randperm(len(rows), generator=generator, device="cpu")  # the generator's device
            order = rows[shuffle.to(rows.device)] if epoch else rows
            for i, minibatch in enumerate(order.tensor_split(self.num_minibatches)):
                stats, pass_gap = self.accumulate_gradients(
                    rollout, minibatch, token_mask, adv_rows, old_logp, ref_logp, is_weights, first_pass_gap
                )
                gap = merge_gaps(gap, pass_gap)
                last = epoch == self.ppo_epochs - 1 and i == self.num_minibatches - 1
                stats["grad_norm"] = self._optimizer_step(optimizer, last)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value

        if scheduler is not None:  # once per training step: a schedule sized by trainer.max_steps ends on time
            scheduler.step()
        if sampler_logp is not None:  # every process logs the same keys (sync_dist pairs them up)
            logs |= {f"train/rollout/mismatch_{k}": v for k, v in gap_means(self._reduce_gap(gap)).items()}
        steps = self.ppo_epochs * self.num_minibatches
        tokens = sums.pop("tokens").clamp_min(1.0)
        elapsed = max(time.perf_counter() - started, 1e-9)
        return {
            "train/loss": sums["loss"] / steps,
            "train/grad_norm": sums["grad_norm"] / steps,
            "train/clip/low": sums["clip_low"] / tokens,
            "train/clip/high": sums["clip_high"] / tokens,
            "train/kl": sums["kl"] / tokens,
            "train/entropy": sums["entropy"] / tokens,
            "train/throughput/update_tok_s": tokens / elapsed,
            "train/update/rows_skipped": sums["rows_skipped"] / steps,
        } | logs

    def accumulate_gradients(
        self,
        rollout: RolloutBatch,
        rows: Tensor,
        token_mask: Tensor,
        advantages: Tensor,
        old_logp: Tensor | None,
        ref_logp: Tensor | None,
        is_weights: Tensor | None = None,
        sampler_logp: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """Backward of the global-batch loss restricted to ``rows``, micro-batch by micro-batch.

        Returns the statistics to log and, with ``sampler_logp``, the sampler-trainer log-prob gap
        (``sgrpo.loss.logprob_gap``) on the tokens that ran.


        Without a KL term, rows whose advantage is exactly 0 (constant groups) are counted in the
        denominators but not run: their loss and gradient are exactly 0. Clip fractions, entropy
        and update tokens/s then describe the rows that ran.

        The aggregation denominators are the counts of the whole mini-batch over all processes, so
        the accumulated gradient does not depend on how the mini-batch is split. DDP averages
        gradients over processes; the loss is multiplied by the world size to undo that.
        """
        counts = torch.stack([token_mask.new_tensor(len(rows), dtype=torch.float32), token_mask[rows].sum().float()])
        num_seqs, num_tokens = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        skipped = len(rows)
        if self.kl_coef == 0:  # a row with advantage exactly 0 adds exactly 0 to the loss and its gradient
            rows = rows[advantages[rows] != 0]
        skipped -= len(rows)
        chunks = self._micro_batches(rollout, rows, token_mask)  # no rows (all groups dropped): no forward
        # every process runs as many backwards (DDP, FSDP collectives); one zero-loss pass when every row
        # had advantage 0 gives the zero gradient running them would have (AdamW still decays)
        backwards = max(self._max_over_processes(len(chunks)), 1 if num_seqs > 0 else 0)
        scale = float(self._data_parallel_size())
        stats = {
            k: torch.zeros((), device=self.device) for k in ("loss", "clip_low", "clip_high", "kl", "entropy", "tokens")
        }
        stats["rows_skipped"] = torch.tensor(float(skipped), device=self.device)
        gap = None
        for j, chunk in enumerate(chunks):
            batch = trim(rollout, chunk, token_mask)
            logp, entropy = completion_logprobs(
                self.model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["mask"],
                self.rollout.temperature,
                chunk_mib=self.logits_chunk_mib,
                share_prompts=self.share_prompts,
                with_entropy=True,
            )
            t = logp.shape[1]
            old = logp.detach() if old_logp is None else old_logp[chunk][:, :t]
            if sampler_logp is not None:
                gap = merge_gaps(gap, logprob_gap(old, sampler_logp[chunk][:, :t], batch["mask"]))
            per_token, low, high = clipped_surrogate(logp, old, advantages[chunk], self.clip_low, self.clip_high)
            if is_weights is not None:  # TIS: x min(pi_old / pi_sampler, C) per token, a constant
                per_token = per_token * is_weights[chunk][:, :t]
            kl = k3_kl(logp, ref_logp[chunk][:, :t]) if ref_logp is not None else torch.zeros_like(logp)
            per_token = per_token + self.kl_coef * kl if ref_logp is not None else per_token
            weights = token_weights(batch["mask"], self.aggregation, num_seqs, num_tokens, self.rollout.max_new_tokens)
            loss = (per_token * weights).sum()
            self._backward(loss * scale, sync=j == backwards - 1)
            m = batch["mask"].float()
            stats["loss"] += loss.detach() * scale  # the global loss once averaged over processes
            stats["clip_low"] += (low.float() * m).sum()
            stats["clip_high"] += (high.float() * m).sum()
            stats["kl"] += (kl.detach() * m).sum()
            stats["entropy"] += (entropy * m).sum()
            stats["tokens"] += m.sum()
        for j in range(len(chunks), backwards):
            self._backward(self._dummy_logits(self.model).sum() * 0.0, sync=j == backwards - 1)
        return stats, gap


    def _backward(self, loss: Tensor, sync: bool) -> None:
        """``manual_backward``; under DDP only the last backward of an optimiser step all-reduces."""
        with gradient_sync(self.trainer.strategy.model, enabled=sync):
            self.manual_backward(loss)

    def _reduce_gap(self, gap: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """``logprob_gap`` sums over all processes (a process whose rows all had advantage 0 has none)."""
        zero = torch.zeros((), device=self.device)
        gap = gap or {"kl": zero, "abs_diff": zero, "max_abs": zero, "tokens": zero}
        sums = self.trainer.strategy.reduce(torch.stack([gap["kl"], gap["abs_diff"], gap["tokens"]]), reduce_op="sum")
        largest = self.trainer.strategy.reduce(gap["max_abs"].float(), reduce_op="max")
        return {"kl": sums[0], "abs_diff": sums[1], "tokens": sums[2], "max_abs": largest}

    def _max_over_processes(self, n: int) -> int:

        return int(self.trainer.strategy.reduce(torch.tensor(float(n), device=self.device), reduce_op="max"))

    def _dummy_logits(self, model) -> Tensor:
        """A one-token forward, so that every process runs as many forwards (FSDP2 gathers in each)."""
        dummy = torch.full((1, 1), self.tokenizer.pad_token_id or 0, device=self.device)
        return model(input_ids=dummy).logits

    def _optimizer_step(self, optimizer, last: bool) -> Tensor:
        """One optimiser step through Lightning's precision plugin; returns the gradient norm before clipping.

        The plugin unscales fp16 gradients, then calls ``on_before_optimizer_step`` (where the norm is
        taken and clipped), then steps (a GradScaler skips steps with non-finite gradients).
        """
        self._grad_norm = torch.zeros((), device=self.device)
        if last:  # the step Lightning counts: trainer.global_step == training steps
            optimizer.step()
        else:
            self.trainer.strategy.optimizer_step(optimizer.optimizer, closure=lambda: None, model=self)
        optimizer.zero_grad(set_to_none=True)
        return self._grad_norm

    def on_before_optimizer_step(self, optimizer) -> None:
        """Norm and clip the (unscaled) gradients: Lightning calls this after the plugin's ``unscale_``."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)  # fused optimisers unscale inside step(), after this hook: do it now
        self._grad_norm = clip_gradients(self.model, self.max_grad_norm)

    def _micro_batches(self, rollout: RolloutBatch, rows: Tensor, token_mask: Tensor) -> list[Tensor]:
        """``rows`` in micro-batches of similar completion length (``sgrpo.batching.micro_batches``)."""
        lengths = token_mask[rows].sum(-1)
        return micro_batches(rows, lengths, rollout.prompt_length, self.micro_batch_size, self.micro_batch_tokens)

    @torch.no_grad()
    def _logprobs(self, model, rollout: RolloutBatch, token_mask: Tensor) -> Tensor:
        """Log-probs ``[N, T]`` of the completion tokens under ``model`` (0 off ``token_mask``), no gradient."""
        out = torch.zeros(token_mask.shape, dtype=torch.float32, device=token_mask.device)
        rows = token_mask.any(-1).nonzero().squeeze(-1)
        chunks = self._micro_batches(rollout, rows, token_mask)
        for _ in range(self._max_over_processes(len(chunks)) - len(chunks)):  # processes' chunk counts differ
            self._dummy_logits(model)
        for chunk in chunks:
            batch = trim(rollout, chunk, token_mask)
            lp, _ = completion_logprobs(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                batch["mask"],
                self.rollout.temperature,
                chunk_mib=self.logits_chunk_mib,
                share_prompts=self.share_prompts,
            )
            out[chunk, : lp.shape[1]] = lp
        return out

    def _log_mean(self, values: dict[str, Tensor | float], prog_bar: tuple[str, ...] = ()) -> None:
        world = self.trainer.world_size if self._trainer else 1
        for key, value in values.items():
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device)
            self.log(key, value, prog_bar=key in prog_bar, sync_dist=world > 1)

    # ------------------------------------------------------------------ validation
    def validation_step(self, examples: list[Example], batch_idx: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_mix(self.seed, batch_idx, self.global_rank, 7))
            rollout = self.val_rollout.generate(
                self.model, self.tokenizer, examples, self.val_samples, greedy=self.val_greedy
            )
        repeated = [ex for ex in examples for _ in range(self.val_samples)]
        with torch.device("cpu"):  # host tensors from the task, as in `score`
            correct = self.task.successes(repeated, rollout.completions).view(len(examples), self.val_samples)
        self._val_outputs.append((correct.cpu(), [ex.difficulty for ex in examples]))

    def on_validation_epoch_end(self) -> None:
        outputs, self._val_outputs = self._val_outputs, []
        if self.trainer.world_size > 1:
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, outputs)
            outputs = [o for part in gathered for o in part]
        if not outputs or self.trainer.sanity_checking:
            return
        correct = torch.cat([c for c, _ in outputs])  # [prompts, n]
        levels = [lv for _, lvs in outputs for lv in lvs]
        metrics = {
            f"val/pass@{k}": pass_at_k(correct.sum(-1), self.val_samples, k).mean().item()
            for k in range(1, self.val_samples + 1)
        }
        metrics["val/accuracy"] = correct.float().mean().item()
        by_level = accuracy_by_difficulty(correct, levels)
        metrics |= {f"val/accuracy/{level}": acc for level, acc in by_level.items()}
        self.val_history.append(
            {"step": self.rollout_step, "accuracy": metrics["val/accuracy"], "by_difficulty": by_level}
        )
        self.log_dict(metrics, prog_bar=False, rank_zero_only=True)

    # ------------------------------------------------------------------ export
    def on_fit_end(self) -> None:
        state = None
        if self.device_mesh is not None:  # gather the shards (a collective: every process takes part)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.trainer.is_global_zero:
            self.export(Path(self.export_dir or Path(self.trainer.default_root_dir) / "hf_model"), state)

    def export(self, path: Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Save the policy with ``save_pretrained`` (loadable by transformers alone)."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=state_dict)
        # FSDP2 swaps in a subclass named FSDP<Model>: record the model's own class
        base = next(c for c in type(self.model).__mro__ if not c.__name__.startswith("FSDP"))
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [base.__name__]
        (path / "config.json").write_text(json.dumps(config, indent=2))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path

    def _data_parallel_size(self) -> int:
        layout = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(layout.get("num_replicas", 1))


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> Tensor:
    """Total L2 norm of ``model``'s gradients (over all shards under FSDP2), then clip it to ``max_norm``."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(model.parameters()).device)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded (DTensor) gradients, reduced over shards
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.detach()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _mix(*parts: int) -> int:
    """A deterministic 63-bit seed from integers."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def _constant(rewards: Tensor) -> Tensor:
    return rewards.amax(-1) == rewards.amin(-1)  # [B]
