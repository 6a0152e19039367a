"""``MicroBatchLogprobs``, mixed into ``PolicyUpdate``: a rollout's rows in micro-batches (packed, cost-balanced bins,
as many on every process; padded, rows of similar length), their log-probs under a model (packed, each group's
prompt once where it pays, or padded), the packing verdict decided once per model on every process, and the
layout metrics (``train/padding_fraction``, ``train/tokens_per_micro_batch``, ``train/update/token_imbalance``)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from sgrpo.distributed import any_process, max_over_processes
from sgrpo.model.logprobs import completion_logprobs, packing_problem
from sgrpo.model.packed_path import attention_path, choose_attention, sharing_verdict
from sgrpo.model.packing import attention_implementation, layout_tokens, one_row, shared_layout_tokens, shared_pays
from sgrpo.train.batching import trim, update_micro_batches
from sgrpo.types import RolloutBatch

log = logging.getLogger("sgrpo.train.update")

#: a micro-batch layout's token counts (``sgrpo.model.packing.layout_tokens``) summed over an update
LAYOUT = ("layout_real", "layout_padded", "layout_ran", "layout_chunks")


class MicroBatchLogprobs:
    """Reads the policy's ``packing``, ``share_prompts``, ``micro_batch_size``, ``micro_batch_tokens``,
    ``logits_chunk_mib``, ``rollout.temperature``, ``device``, ``trainer`` and ``model``; ``_dummy_logits`` is
    ``PolicyUpdate``'s (a process with fewer chunks runs as many forwards)."""

    @torch.no_grad()
    def _logprobs(self, model: nn.Module, rollout: RolloutBatch, token_mask: Tensor) -> Tensor:
        """Log-probs ``[N, T]`` of the completion tokens under ``model`` (0 off ``token_mask``), no gradient."""
        self._packs(model)  # before any process's chunk loop: every process runs the check's forwards
        out = torch.zeros(token_mask.shape, dtype=torch.float32, device=token_mask.device)
        chunks = self._micro_batches(rollout, token_mask.any(-1).nonzero().squeeze(-1), token_mask, model)
        for _ in range(max_over_processes(self.trainer.strategy, len(chunks)) - len(chunks)):
            self._dummy_logits(model)  # processes' chunk counts differ: every process runs as many forwards
        for chunk in chunks:
            logp, _, _ = self._chunk_logprobs(model, rollout, chunk, token_mask)
            out[chunk, : logp.shape[1]] = logp
        return out

    def _chunk_logprobs(
        self, model: nn.Module, rollout: RolloutBatch, chunk: Tensor, token_mask: Tensor, stats: dict | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """One micro-batch, trimmed: log-probs ``[n, T]`` under ``model`` and its token mask; with ``stats`` (the
        gradient pass), entropies too, and its layout's token counts added to ``stats`` (``LAYOUT``)."""
        batch = trim(rollout, chunk, token_mask)
        packing, share = self._packs(model), self._shares(model)
        if stats is not None:
            hidden = getattr(model.config, "hidden_size", None)
            real, padded, ran = layout_tokens(batch["attention_mask"], batch["mask"], one_row(model), hidden)
            if share and shared_pays(batch["attention_mask"], batch["mask"], batch["input_ids"], hidden):
                real, ran = shared_layout_tokens(batch["input_ids"], batch["attention_mask"], batch["mask"], hidden)
            for name, value in zip(LAYOUT, (real, padded, ran if packing else padded, 1)):
                stats[name] += value
        logp, entropy = completion_logprobs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["mask"],
            self.rollout.temperature,
            chunk_mib=self.logits_chunk_mib,
            share_prompts=share if packing else self.share_prompts,
            with_entropy=stats is not None,
            packing=packing,
        )
        return logp, entropy, batch["mask"]

    def _packs(self, model: nn.Module) -> bool:
        """Whether ``model``'s log-probs run packed: ``packing`` is on and ``packing_problem`` found nothing on any
        process (checked once per model; else the padded path, with a one-line warning saying why). On an
        accelerator the model first gets the packed path's attention (``choose_attention``); one log line names it."""
        return self._packing_verdict(model)[0]

    def _shares(self, model: nn.Module) -> bool:
        """Whether packed log-probs run each group's prompt once (``sgrpo.model.packed_path.sharing_verdict``)."""
        return self._packing_verdict(model)[1]

    def _packing_verdict(self, model: nn.Module) -> tuple[bool, bool]:
        """(packs, shares), decided once per model by every process at the same point (collectives)."""
        verdicts = self.__dict__.setdefault("_packing_verdicts", {})  # a plain dict: not state, not a submodule
        if not self.packing:
            return False, False
        if id(model) not in verdicts:
            before = attention_implementation(model)
            choose_attention(model, self.device.type)
            try:
                problem = packing_problem(model)
            except Exception as err:  # a kernel that refuses the probe's inputs (dtype, shape): the padded path
                problem = f"the check raised {type(err).__name__}: {err}"
            packs = not any_process(problem is not None, self.device)
            if not packs and attention_implementation(model) != before:  # the padded path runs as it ran before
                model.set_attn_implementation(before)
            sharing = sharing_verdict(model, self.device) if packs and self.share_prompts else None
            verdicts[id(model)] = packs, packs and self.share_prompts and sharing is None
            if self.trainer.is_global_zero:
                if packs:
                    log.info("model.packing: packed log-probs, %s", attention_path(model, verdicts[id(model)][1]))
                else:
                    reason = problem or "the check failed on another process"
                    log.warning("model.packing: falling back to padded log-probs: %s", reason)
                if sharing is not None:
                    log.warning("model.share_prompts: packed rows hold each completion's own prompt copy: %s", sharing)
        return verdicts[id(model)]

    def _layout_logs(self, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """The update's layout metrics, from ``LAYOUT``'s sums (popped), over every process: padding share of what ran
        and of what the padded path runs, real tokens per micro-batch, and the largest process's tokens over the mean
        (1: balanced)."""
        local = torch.stack([sums.pop(name).float() for name in LAYOUT])
        local = torch.cat([local, torch.ones_like(local[:1])])  # and 1 per process: their count
        most = self.trainer.strategy.reduce(local[2].clone(), reduce_op="max")  # reduce all-reduces in place
        real, padded, ran, chunks, processes = self.trainer.strategy.reduce(local, reduce_op="sum")
        return {
            "train/padding_fraction": (ran - real) / ran.clamp_min(1.0),
            "train/padding_fraction_padded": (padded - real) / padded.clamp_min(1.0),
            "train/tokens_per_micro_batch": real / chunks.clamp_min(1.0),
            "train/update/token_imbalance": most / (ran / processes).clamp_min(1.0),
        }

    def _micro_batches(self, rollout: RolloutBatch, rows: Tensor, token_mask: Tensor, model=None) -> list[Tensor]:
        """``rows`` in micro-batches (``sgrpo.train.batching.update_micro_batches``): packed, cost-balanced bins,
        as many on every process; padded, rows of similar completion length."""
        model = self.model if model is None else model
        packed = self._packs(model)
        hidden = getattr(model.config, "hidden_size", None) if packed else None
        agree = lambda bins: max_over_processes(self.trainer.strategy, bins)  # noqa: E731
        share = self._shares(model)
        return update_micro_batches(
            rollout, rows, token_mask, packed, hidden, self.micro_batch_size, self.micro_batch_tokens, agree, share
        )
