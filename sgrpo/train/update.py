"""The update of one rollout: ``ppo_epochs`` x ``num_minibatches`` optimiser steps, micro-batch by micro-batch.

``PolicyUpdate`` is mixed into ``GRPOPolicy`` (a LightningModule with manual optimisation) and reads its
``model``, ``_reference``, ``loss`` (a ``sgrpo.train.PolicyLoss``), ``rollout`` (temperature, max_new_tokens,
whether it samples through the policy's own weights), the micro-batch settings and ``seed``, and
Lightning's strategy and precision plugin. Everything that must line up across processes is here:

* the loss denominators are the whole mini-batch's counts over all processes (``BatchCounts``), so the
  accumulated gradient does not depend on how a mini-batch is split into micro-batches or processes;
  DDP averages gradients over processes, so each process's loss is multiplied by their number;
* every process runs as many forwards and backwards (one-token dummy passes pad the short ones), so
  FSDP2's gathers and reduce-scatters pair up; under DDP only an optimiser step's last backward
  all-reduces (``no_sync`` on the others), and so under FSDP2 only it reduce-scatters where the policy's
  ``gradient_sync`` defers (``sgrpo.distributed.defers_gradient_sync``);
* a rollout with rows sampled at older weights (``RolloutBatch.versions`` != ``rollout_step`` on any process) is
  stale: the loss weighs the sampler's log-probs (the decoupled objective, ``sgrpo.train.correction``;
  ``train/offpolicy/*`` from sums added over processes), against proximal log-probs that every process computes
  in a forward of their own when the update takes more than one optimiser step, and that are the gradient pass's
  own, detached, in a single one (``_needs_proximal_forward``); versions all current or absent run exactly the
  synchronous path;
* the gradient norm is taken and clipped in ``on_before_optimizer_step``, after mixed precision's
  GradScaler removed its scale, and the LR scheduler steps once per training step;
* an optimiser step whose loss or gradient norm is not finite on any process is skipped on every process
  (the flag is OR-ed over processes, else their weights would part): its gradients are dropped before the
  optimiser runs, so no weight, moment or step count changes; ``train/skipped_steps`` counts them, and
  ``max_nonfinite_steps`` in a row stop the run (``sgrpo.run.guards.DivergenceWatch``). A step that leaves a
  weight non-finite (finite gradients, an overflowing update) stops the run at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from sgrpo.distributed import any_process, data_parallel_size, gradient_sync, max_over_processes
from sgrpo.model.loading import largest_magnitude
from sgrpo.model.logprobs import gap_means, logprob_gap, merge_gaps
from sgrpo.rollout.engine import bump_weights_version
from sgrpo.run.data import mix_seed
from sgrpo.run.guards import DivergenceError
from sgrpo.train.correction import SequenceCorrection, offpolicy_metrics
from sgrpo.train.exchange import BalancedRows
from sgrpo.train.gapwatch import GapWatch
from sgrpo.train.loss import BatchCounts, TokenBatch, loss_groups
from sgrpo.train.micro_logprobs import LAYOUT, MicroBatchLogprobs
from sgrpo.train.reference import reference_model
from sgrpo.train.sequences import minibatch_rows, sequence_budget, sequence_tokens, trajectory_count, trajectory_sums
from sgrpo.types import RolloutBatch

log = logging.getLogger(__name__)

#: the last part of the update's dropout seed (the rollout's takes the sampling round there: rounds stay far below)
DROPOUT_STREAM = 0xD50


class PolicyUpdate(BalancedRows, MicroBatchLogprobs):
    """``update(rollout, advantages, keep_groups)``: the optimiser steps of one training step (module docstring)."""

    def update(self, rollout: RolloutBatch, advantages: Tensor, keep_groups: Tensor) -> dict[str, Tensor]:
        """Optimiser steps on one rollout; returns the metrics to log.

        ``advantages`` ``[B, G]``; ``keep_groups`` ``[B]`` (dynamic sampling drops the others). With
        ``keep_dropout`` the dropout masks come from a seed of (seed, step, process), as the rollout's samples do, so a
        resumed run draws them again (the global RNG is in no checkpoint).
        """
        if not self.keep_dropout:
            return self._update(rollout, advantages, keep_groups)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(mix_seed(self.seed, self.rollout_step, self.global_rank, DROPOUT_STREAM))
            return self._update(rollout, advantages, keep_groups)

    def _update(self, rollout: RolloutBatch, advantages: Tensor, keep_groups: Tensor) -> dict[str, Tensor]:
        self._packs(self.model)  # decided once per model, by every process at the same point (collectives)
        # model.balance_batch: the step's rows placed over the processes before any log-prob pass or mini-batch
        rollout, advantages, keep_groups, balance_logs = self.balanced(rollout, advantages, keep_groups)
        # per row: a multi-turn trajectory's rows share its group's advantage (RolloutBatch.per_row)
        keep_rows = rollout.per_row(keep_groups.repeat_interleave(rollout.group_size))
        token_mask = rollout.completion_mask & keep_rows.unsqueeze(-1)
        if self.mask_truncated:
            token_mask = token_mask & ~rollout.per_row(rollout.truncated).unsqueeze(-1)
        rows = token_mask.any(-1).nonzero().squeeze(-1)  # rows that carry loss
        sampler_logp = rollout.logprobs  # [N, T] the sampler's log-probs of its tokens, if it reports them
        stale = self._stale(rollout)  # rows sampled at older weights (async): the decoupled objective
        external = sampler_logp is not None and not self.rollout.samples_from_policy  # vLLM: other weights, kernels
        external = stale or (external and (self.loss.weighs_sampler or self.loss.bypass))  # the loss weighs mu
        anchor = sampler_logp if external and self.loss.bypass else None  # bypass: mu is the PPO anchor
        old_logp = anchor  # one on-policy pass: the current log-probs, detached, serve (no second forward)
        whole = external and self._trajectory_corrections(rollout)  # every row's proximal log-probs first
        if anchor is None and (self._needs_proximal_forward(external, stale) or whole):
            old_logp = self._logprobs(self.model, rollout, token_mask)  # the trainer's, at the update's start
        ref_logp = None
        if self.loss.needs_reference:  # the frozen reference, or the LoRA policy with its adapters off
            with reference_model(self.model, self._reference) as reference:
                ref_logp = self._logprobs(reference, rollout, token_mask)
        measured = sampler_logp is None or old_logp is None or anchor is not None
        gap = None if measured else logprob_gap(old_logp, sampler_logp, token_mask)
        inputs = {"old": old_logp, "ref": ref_logp, "sampler": sampler_logp if external and anchor is None else None}
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.rollout_step, 1))
        sums: dict[str, Tensor] = {}
        started = time.perf_counter()
        for epoch in range(self.ppo_epochs):  # a trajectory's rows in one mini-batch (sgrpo.train.sequences)
            shuffle = torch.randperm(trajectory_count(rows, rollout.trajectory), generator=generator, device="cpu")
            parts = minibatch_rows(rows, rollout.trajectory, shuffle if epoch else None, self.num_minibatches)
            for i, minibatch in enumerate(parts):
                first = old_logp is None or (anchor is not None and epoch == 0)
                gap_now = sampler_logp if first else None  # measured on this pass's own log-probs
                stats, pass_gap = self.accumulate_gradients(rollout, minibatch, token_mask, advantages, inputs, gap_now)
                gap = merge_gaps(gap, pass_gap)
                last = (epoch, i) == self._last_step()
                stats["grad_norm"], stats["skipped_steps"] = self._optimizer_step(optimizer, last, stats["loss"])
                for key, value in stats.items():  # float32 sums (the norm of bf16-true's gradients is bf16)
                    sums[key] = sums.get(key, 0.0) + value.float()
        if scheduler is not None:  # once per training step: a schedule sized by trainer.max_steps ends on time
            scheduler.step()
        steps = self.ppo_epochs * self.num_minibatches
        logs = self._layout_logs(sums) | {k: torch.tensor(v, dtype=torch.float32, device=self.device)
                                           for k, v in balance_logs.items()}
        local_tokens = sums.pop("tokens")
        logs |= self._token_means(sums, local_tokens)
        logs |= {
            "train/loss": sums["loss"] / steps,
            "train/grad_norm": sums["grad_norm"] / steps,
            "train/throughput/update_tok_s": local_tokens / max(time.perf_counter() - started, 1e-9),
            "train/skipped_steps": sums["skipped_steps"],
        }
        if sampler_logp is not None:  # every process logs the same keys (sync_dist pairs them up)
            means = gap_means(self._reduce_gap(gap))
            logs |= {f"train/rollout/mismatch_{k}": v for k, v in means.items()}
            if not stale:  # a stale batch's gap is mostly staleness, not the sampler's numerics
                self._watch_gap(float(means["abs_diff"]))
        if inputs["sampler"] is not None:  # stale or external: the importance weights (same keys on every process)
            logs |= self._offpolicy_logs(sums)
        return logs

    def _needs_proximal_forward(self, external: bool, stale: bool) -> bool:
        """Whether the proximal log-probs (at the weights the update starts from) need a forward of their own: not
        in one optimiser step (ppo_epochs = num_minibatches = 1) on an on-policy or stale batch, whose gradient pass
        runs at those weights (its log-probs, detached, are them). An external sampler's batch keeps its forward."""
        if self.ppo_epochs > 1 or self.num_minibatches > 1:
            return True
        return external and not stale

    def _trajectory_corrections(self, rollout: RolloutBatch) -> bool:
        """Whether the loss rejects whole sequences (``SequenceCorrection``) of multi-turn episodes: a trajectory's
        rows may lie in several micro-batches, so its statistics come from the proximal log-probs of all of them
        (``trajectory_sums``). Multi-turn, not forked: every process decides alike (the forward is a collective)."""
        corrections = getattr(self.loss, "corrections", ())
        return rollout.episodes is not None and any(isinstance(c, SequenceCorrection) for c in corrections)

    def _stale(self, rollout: RolloutBatch) -> bool:
        """Whether any process's rollout has a row sampled at other weights than the update starts from
        (``RolloutBatch.versions`` != ``rollout_step``): then every process runs the decoupled objective, with the
        behaviour log-probs ``rollout.logprobs``. No versions: on-policy (no collective)."""
        if rollout.versions is None:
            return False
        stale = any_process(bool((rollout.versions != self.rollout_step).any()), self.device)
        if stale and rollout.logprobs is None:
            raise ValueError(
                "a stale rollout (RolloutBatch.versions older than the trainer's step) needs the sampler's log-probs "
                "(RolloutBatch.logprobs) for the importance weights: use an engine that reports them"
            )
        return stale

    def _token_means(self, sums: dict[str, Tensor], tokens: Tensor) -> dict[str, Tensor]:
        """The loss's per-token stats (``PolicyLoss.stats``: clip fractions, kl, the importance weight) and the
        entropy, each sum over every process's loss tokens divided by their count, and ``train/update/rows_skipped``
        summed over processes (one all-reduce). Each process's own ratio, averaged over processes by the logger,
        weighed processes with few tokens like those with many, and one with none (constant groups only) as 0."""
        names = (*self.loss.stats, "entropy", "rows_skipped")
        local = torch.stack([torch.as_tensor(sums[n], dtype=torch.float32, device=self.device) for n in names])
        totals = self.trainer.strategy.reduce(torch.cat([local, tokens.float().reshape(1)]), reduce_op="sum")
        steps = self.ppo_epochs * self.num_minibatches
        means = {f"train/{n}": total / totals[-1].clamp_min(1.0) for n, total in zip(names[:-1], totals[:-2])}
        return means | {"train/update/rows_skipped": totals[-2] / steps}

    def _offpolicy_logs(self, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """``train/offpolicy/*`` (``sgrpo.train.correction.offpolicy_metrics``) from the loss's ``offpolicy_stats``
        sums, added over all processes first (one all-reduce); none when the loss reports none."""
        names = self.loss.offpolicy_stats
        if not names:
            return {}
        reduced = self.trainer.strategy.reduce(torch.stack([sums[n] for n in names]), reduce_op="sum")
        return offpolicy_metrics(dict(zip(names, reduced)))

    def _watch_gap(self, abs_diff: float) -> None:
        """Warn (rank 0) when the all-reduced sampler-trainer gap jumps far above its running level (``GapWatch``)."""
        if getattr(self, "_gap_watch", None) is None:
            self._gap_watch = GapWatch()  # a plain object: not a submodule, not in checkpoints
        message = self._gap_watch.observe(self.rollout_step, abs_diff)
        if message and self.trainer.is_global_zero:
            log.warning(message)

    def accumulate_gradients(
        self,
        rollout: RolloutBatch,
        rows: Tensor,
        token_mask: Tensor,
        advantages: Tensor,
        inputs: dict[str, Tensor | None],
        gap_sampler: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """Backward of the mini-batch loss restricted to ``rows``, micro-batch by micro-batch.

        ``inputs``: ``old``, ``ref`` and ``sampler`` log-probs ``[N, T]`` (or None) for the loss. Returns
        the token-summed statistics and, with ``gap_sampler``, the sampler-trainer log-prob gap on the
        tokens that ran. When the loss is zero at zero advantage, rows whose advantage is exactly 0
        (constant groups) are counted in the denominators but not run; statistics then describe the rows
        that ran.
        """
        group_tokens, groups = None, 0
        if self.loss.rows_per_group is not None:  # the loss's own row groups, whatever the memory micro-batches
            group_tokens = torch.zeros(token_mask.shape[0], dtype=torch.float32, device=token_mask.device)  # [N]
            group_tokens[rows], groups = loss_groups(token_mask[rows].sum(-1), self.loss.rows_per_group)
        trajectories = float(trajectory_count(rows, rollout.trajectory))  # a trajectory is one sequence
        counts = torch.stack([token_mask.new_tensor(trajectories, dtype=torch.float32), token_mask[rows].sum().float()])
        counts = torch.cat([counts, counts.new_tensor([groups])])
        sequences, tokens, groups = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        episodes = rollout.episodes is not None  # Dr.GRPO's L: the most tokens a trajectory can generate
        length = sequence_budget(self.rollout.max_new_tokens, getattr(self, "environment", None), episodes)
        counts = BatchCounts(sequences, tokens, length, groups)
        seq_tokens = sequence_tokens(token_mask, rows, rollout.trajectory)  # [N] or None (single-turn)
        seq_sums = None  # [N, 3] each row's trajectory's statistics, for a SequenceCorrection (forked episodes)
        if inputs["sampler"] is not None and inputs["old"] is not None and self._trajectory_corrections(rollout):
            seq_sums = trajectory_sums(inputs["old"], inputs["sampler"], token_mask, rows, rollout.trajectory)
        adv_rows = rollout.per_row(advantages.reshape(-1))  # [N'] each row its trajectory's advantage
        skipped = len(rows)
        if self.loss.zero_at_zero_advantage:
            rows = rows[adv_rows[rows] != 0]
        skipped -= len(rows)
        chunks = self._micro_batches(rollout, rows, token_mask)  # no rows (all groups dropped): no forward
        # every process runs as many backwards (DDP, FSDP collectives); one zero-loss pass when every row
        # had advantage 0 gives the zero gradient running them would have (AdamW still decays)
        backwards = max(max_over_processes(self.trainer.strategy, len(chunks)), 1 if sequences > 0 else 0)
        self._no_gradients = backwards == 0  # the same on every process: no sequence anywhere (_optimizer_step)
        scale = float(data_parallel_size(self.trainer.strategy))
        names = ("loss", "entropy", "tokens", *self.loss.stats, *self.loss.offpolicy_stats)
        stats = {name: torch.zeros((), dtype=torch.float32, device=self.device) for name in names}  # not bf16-true's
        stats["rows_skipped"] = torch.tensor(float(skipped), dtype=torch.float32, device=self.device)
        stats |= {name: torch.zeros((), dtype=torch.float32, device=self.device) for name in LAYOUT}
        gap = None
        for j, chunk in enumerate(chunks):
            logp, entropy, mask = self._chunk_logprobs(self.model, rollout, chunk, token_mask, stats)
            t = logp.shape[1]
            old = logp.detach() if inputs["old"] is None else inputs["old"][chunk][:, :t]
            if gap_sampler is not None:
                gap = merge_gaps(gap, logprob_gap(logp.detach(), gap_sampler[chunk][:, :t], mask))
            ref, sampler = (None if x is None else x[chunk][:, :t] for x in (inputs["ref"], inputs["sampler"]))
            rows_groups = None if group_tokens is None else group_tokens[chunk]
            batch = TokenBatch(logp, old, adv_rows[chunk], mask, ref, sampler, rows_groups,
                               None if seq_tokens is None else seq_tokens[chunk],
                               None if seq_sums is None else seq_sums[chunk])  # fmt: skip
            loss, loss_stats = self.loss(batch, counts)
            self._backward(loss * scale, sync=j == backwards - 1)
            stats["loss"] += loss.detach() * scale  # the mini-batch loss once averaged over processes
            stats["entropy"] += (entropy * mask).sum()
            stats["tokens"] += mask.sum()
            for name in (*self.loss.stats, *self.loss.offpolicy_stats):
                stats[name] += loss_stats[name].detach() if name in loss_stats else 0.0  # offpolicy: with weights
        for j in range(len(chunks), backwards):
            self._backward(self._dummy_logits(self.model).sum() * 0.0, sync=j == backwards - 1)
        return stats, gap

    def _backward(self, loss: Tensor, sync: bool) -> None:
        """``manual_backward``; under DDP (and FSDP2 with ``gradient_sync`` deferred) only the last backward of an
        optimiser step reduces the gradients."""
        with gradient_sync(self.model if self.defer_gradient_sync else self.trainer.strategy.model, enabled=sync):
            self.manual_backward(loss)

    def _dummy_logits(self, model: nn.Module) -> Tensor:
        """A one-token forward, so that every process runs as many forwards (FSDP2 gathers in each)."""
        dummy = torch.full((1, 1), self.tokenizer.pad_token_id or 0, device=self.device)
        return model(input_ids=dummy).logits

    def _last_step(self) -> tuple[int, int]:
        return self.ppo_epochs - 1, self.num_minibatches - 1

    def _optimizer_step(self, optimizer, last: bool, loss: Tensor) -> tuple[Tensor, Tensor]:
        """One optimiser step through Lightning's precision plugin; returns the gradient norm before clipping and
        1.0 if the step was skipped (a non-finite ``loss`` or gradient norm on any process), else 0.0.

        The plugin unscales fp16 gradients, then calls ``on_before_optimizer_step`` (where the norm is
        taken and clipped, and a non-finite step's gradients dropped), then steps (a GradScaler skips
        steps with non-finite gradients).
        """
        self._grad_norm = torch.zeros((), dtype=torch.float32, device=self.device)
        self._step_loss, self._step_skipped = loss, False
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        idle = scaler is not None and getattr(self, "_no_gradients", False)
        with scaler_paused(scaler) if idle else contextlib.nullcontext():
            if last:  # the step Lightning counts: trainer.global_step == training steps
                optimizer.step()
            else:
                self.trainer.strategy.optimizer_step(optimizer.optimizer, closure=lambda: None, model=self)
        optimizer.zero_grad(set_to_none=True)
        self.divergence_watch.observe(self._step_skipped, self.rollout_step + 1, self._divergence_hint(optimizer))
        if not self._step_skipped and not bool(torch.isfinite(largest_magnitude(self.model.parameters()))):
            raise DivergenceError(
                f"training diverged at step {self.rollout_step + 1}: an update with finite gradients made weights "
                f"infinite or NaN, so the run stops before any checkpoint or export holds them; likely cause: "
                f"{self._divergence_hint(optimizer)}; resume from a checkpoint with a lower lr"
            )
        if not self._step_skipped:
            bump_weights_version(self.model)  # an engine with its own copy of the weights (vLLM) syncs again
        return self._grad_norm, torch.tensor(float(self._step_skipped), dtype=torch.float32, device=self.device)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Norm and clip the (unscaled) gradients: Lightning calls this after the plugin's ``unscale_``. A step
        whose loss or norm is not finite on any process drops its gradients: the optimiser then skips every
        weight (torch's optimisers pass over parameters without a gradient).

        Under fp16 loss scaling an overflowing gradient with a finite loss is the GradScaler's to skip (and
        to shrink its scale): such a step is not counted as divergence.
        """
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)  # fused optimisers unscale inside step(), after this hook: do it now
        self._grad_norm = clip_gradients(self.model, self.max_grad_norm)
        loss = getattr(self, "_step_loss", None)
        loss_finite = loss is None or bool(torch.isfinite(loss))
        norm_finite = scaler is not None or bool(torch.isfinite(self._grad_norm))
        self._step_skipped = any_process(not (loss_finite and norm_finite), self.device)
        if self._step_skipped:
            optimizer.zero_grad(set_to_none=True)

    def _divergence_hint(self, optimizer) -> str:
        """The likely cause of a divergence, with the settings to change."""
        lr = float(optimizer.param_groups[0].get("lr", float("nan")))
        clip = "off (model.max_grad_norm: null)" if self.max_grad_norm is None else f"{self.max_grad_norm:g}"
        return f"a learning rate too high (lr {lr:g}; gradient clipping {clip})"

    def _reduce_gap(self, gap: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """``logprob_gap`` sums over all processes (a process whose rows all had advantage 0 has none)."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        gap = gap or {"kl": zero, "abs_diff": zero, "max_abs": zero, "tokens": zero}
        sums = self.trainer.strategy.reduce(torch.stack([gap["kl"], gap["abs_diff"], gap["tokens"]]), reduce_op="sum")
        largest = self.trainer.strategy.reduce(gap["max_abs"].float(), reduce_op="max")
        return {"kl": sums[0], "abs_diff": sums[1], "tokens": sums[2], "max_abs": largest}


def clip_gradients(model: nn.Module, max_norm: float | None) -> Tensor:
    """Total L2 norm of ``model``'s gradients (over all shards under FSDP2), then clip it to ``max_norm``."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded (DTensor) gradients, reduced over shards
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.detach()


@contextlib.contextmanager
def scaler_paused(scaler) -> Iterator[None]:
    """16-mixed's GradScaler off for an optimiser step no process computed a gradient for (every group dropped by
    dynamic sampling, every kept row truncated under ``mask_truncated``): it has nothing to unscale and raises
    (``Attempted unscale_ but _scale is None`` at the first step, ``No inf checks were recorded`` later). Off, it
    calls the optimiser's own ``step``, which passes over parameters without a gradient, as under 32-true and
    bf16-mixed, and leaves its scale as it was."""
    enabled = scaler._enabled
    scaler._enabled = False
    try:
        yield
    finally:
        scaler._enabled = enabled
