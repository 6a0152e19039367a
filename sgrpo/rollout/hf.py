"""``HFRollout``: sampling from the trained model itself (sgrpo's lean decoder, or transformers' ``generate``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from sgrpo.distributed import is_sharded, world_size
from sgrpo.rollout.engine import RolloutEngine, completion_mask_until_eos, left_padded, render_prompt, stop_and_pad_ids
from sgrpo.rollout.snapshot import RolloutWeights
from sgrpo.types import Example, RolloutBatch

_TENSOR_FIELDS = ("input_ids", "attention_mask", "completion_mask", "truncated", "logprobs", "nucleus_mass")
_TENSOR_FIELDS += ("trajectory",)


class HFRollout(RolloutEngine):
    """Sampling from the trained model itself, with KV cache, left padding and mask-derived position ids.

    Samples at ``temperature`` with optional ``top_p`` / ``top_k`` and stops each row at EOS or
    ``max_new_tokens`` (EOS is masked for a row's first ``min_new_tokens`` tokens). Rows are
    generated ``max_batch_rows`` at a time to bound memory. ``decoder="lean"`` (default) runs
    ``sgrpo.rollout.decode.decode``: each prompt prefilled once for its G rows, a preallocated KV cache,
    finished rows dropped; ``decoder="generate"`` runs transformers' ``generate`` (same
    distribution, slower; it also applies whatever the model's ``generation_config`` adds, such as a
    repetition penalty). The lean decoder returns the sampled tokens' log-probs (``RolloutBatch.logprobs``,
    from the same float32 head as the loss): the policy compares them with its own on the same tokens
    and logs the gap (``train/rollout/mismatch_*``), which should be float rounding only.
    ``weights_snapshot`` (``sgrpo.rollout.snapshot.RolloutWeights``): decode on an unsharded copy of the
    weights gathered once per rollout (default: for FSDP2-sharded models, whose every forward would
    otherwise all-gather each block per token), its Linear weights cast once to autocast's dtype;
    the copy's memory is freed before the update. ``cuda_graphs`` (lean decoder, Llama-family models):
    fixed-shape decode steps replayed as CUDA graphs on a GPU, kept across rollouts (``sgrpo.rollout.graphs``; off
    until measured).

    Args:
        max_new_tokens: Completion length cap in tokens.
        temperature: Sampling temperature (> 0; the loss uses the same).
        top_p: Nucleus sampling (1: off); in training the loss's log-probs stay the full softmax's, as verl's.
        top_k: Top-k sampling (0: off; refused for training).
        max_batch_rows: Rows decoded at once (bounds the KV cache). Another value draws other samples (the same
            distribution): a resume refuses a change of it unless ``--resume_changes allow``.
        min_new_tokens: EOS masked for this many tokens (0: off; refused for training).
        decoder: "lean" (sgrpo's decoder) or "generate" (transformers').
        weights_snapshot: Decode on weights gathered once per rollout (null: on for FSDP2-sharded models).
        cuda_graphs: Replay decode steps as CUDA graphs (GPU, lean decoder, Llama-family models).

    With ``model.environment``, ``generate_episodes`` runs multi-turn episodes (``sgrpo.rollout.episodes``): the
    turns of every running episode sampled together, each turn up to ``max_new_tokens``.
    """

    runs_episodes = True

    def __init__(
        self,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_batch_rows: int = 512,
        min_new_tokens: int = 0,
        decoder: str = "lean",
        weights_snapshot: bool | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be > 0 (use greedy validation for argmax), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0 or max_batch_rows < 1:
            raise ValueError(f"top_k must be >= 0 and max_batch_rows >= 1, got {top_k}, {max_batch_rows}")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
        if decoder not in ("lean", "generate"):
            raise ValueError(f"decoder must be 'lean' or 'generate', got {decoder!r}")
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_batch_rows = max_batch_rows
        self.min_new_tokens = min_new_tokens
        self.decoder = decoder
        self.weights_snapshot, self.cuda_graphs = weights_snapshot, cuda_graphs
        self._weights = RolloutWeights(weights_snapshot)
        self._graphs = None  # cuda_graphs: the decode steps and graphs kept across rollouts (GraphCache)

    def __getstate__(self) -> dict:
        """The settings without what a rollout keeps (the weights' shell, CUDA graphs and their buffers): what the
        async producer is sent, which must not carry the trainer's model or graphs into its process."""
        state = dict(self.__dict__)
        state["_weights"], state["_graphs"] = RolloutWeights(self.weights_snapshot), None
        return state

    def generate(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, greedy: bool = False,
        environment=None,
    ) -> RolloutBatch:  # fmt: skip
        # FSDP2 reuses its gathered-parameter buffers across modes: inference tensors would poison them
        with torch.no_grad() if is_sharded(model) else torch.inference_mode():
            batch = self._sample(model, tokenizer, examples, group_size, greedy, environment)
        # inference tensors cannot enter autograd (the update embeds these ids): make normal copies
        copies = {k: getattr(batch, k).clone() for k in _TENSOR_FIELDS if getattr(batch, k) is not None}
        return dataclasses.replace(batch, **copies)

    def generate_episodes(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, environment,
        greedy: bool = False,
    ) -> RolloutBatch:  # fmt: skip
        return self.generate(model, tokenizer, examples, group_size, greedy, environment)

    def _episodes(self, model, sampler, tokenizer, examples, group_size: int, environment, greedy) -> RolloutBatch:
        """Episodes decoded on ``sampler`` (the model, or its weights gathered once: no collective per turn, so
        processes may run different numbers of turns)."""
        from sgrpo.rollout.episodes import batched_turns, run_episodes

        if is_sharded(model) and world_size() > 1 and sampler is model:
            raise ValueError("multi-turn episodes under FSDP2 need rollout.weights_snapshot null or true (processes "
                             "run different numbers of turns, so decoding must not gather per forward)")  # fmt: skip
        eos, pad = stop_and_pad_ids(model, tokenizer)
        positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        rows = lambda ids, mask, row_prompt, limit: self._generate_rows(sampler, ids, mask, row_prompt, eos, pad,  # noqa: E731
                                                                        greedy, limit)  # fmt: skip
        device = next(model.parameters()).device
        turns = batched_turns(rows, pad, device, self.max_new_tokens, positions)
        return run_episodes(turns, tokenizer, examples, group_size, environment, eos, pad, device, self.max_batch_rows,
                            positions, reports=self.sampler_reports(greedy))  # fmt: skip

    def _sample(
        self, model: nn.Module, tokenizer, examples: Sequence[Example], group_size: int, greedy: bool,
        environment=None,
    ) -> RolloutBatch:  # fmt: skip
        if environment is not None:
            was_training = model.training
            model.eval()
            try:
                with self._weights(model) as sampler:
                    return self._episodes(model, sampler, tokenizer, examples, group_size, environment, greedy)
            finally:
                model.train(was_training)
        device = next(model.parameters()).device
        texts = [render_prompt(tokenizer, ex.prompt, ex.chat_template_kwargs) for ex in examples]
        eos, pad = stop_and_pad_ids(model, tokenizer)
        ids, attn = left_padded(tokenizer(texts, add_special_tokens=False)["input_ids"], pad, device)  # [B, P]
        row_prompt = torch.arange(len(examples), device=device).repeat_interleave(group_size)  # [N]
        was_training = model.training
        model.eval()
        try:
            with self._weights(model) as sampler:  # the model itself, or its weights gathered once
                pieces = []
                for rows in row_prompt.split(self.max_batch_rows):
                    first, last = int(rows[0]), int(rows[-1]) + 1  # rows come in prompt order
                    pieces.append(
                        self._generate_rows(sampler, ids[first:last], attn[first:last], rows - first, eos, pad, greedy)
                    )
        finally:
            model.train(was_training)

        width = max(p.shape[1] for p, _, _ in pieces)
        new = torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p, _, _ in pieces])  # [N, T]
        mask, truncated = completion_mask_until_eos(new, eos)
        length = int(mask.sum(-1).max())
        new, mask = new[:, :length], mask[:, :length]
        new = new.masked_fill(~mask, pad)
        logprobs, masses = (self._joined([piece[i] for piece in pieces], width, length, mask) for i in (1, 2))
        completions = tokenizer.batch_decode(new, skip_special_tokens=True)
        return RolloutBatch(
            input_ids=torch.cat([ids[row_prompt], new], 1),
            attention_mask=torch.cat([attn[row_prompt], mask.long()], 1),
            completion_mask=mask,
            completions=completions,
            truncated=truncated,
            group_size=group_size,
            logprobs=logprobs,
            nucleus_mass=masses,
        )

    def _graph_cache(self):
        if self.cuda_graphs and self._graphs is None:
            from sgrpo.rollout.graphs import GraphCache

            self._graphs = GraphCache()
        return self._graphs

    @staticmethod
    def _joined(parts: list[Tensor | None], width: int, length: int, mask: Tensor) -> Tensor | None:
        """Per-token values ``[R_i, T_i]`` of each piece as one ``[N, T]`` (0 off ``mask``); None if a piece has
        none."""
        if any(part is None for part in parts):
            return None
        joined = torch.cat([nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])[:, :length]
        return joined.masked_fill(~mask, 0.0)

    def sampler_reports(self, greedy: bool) -> tuple[bool, bool]:
        """What ``_generate_rows`` returns besides the tokens: (log-probs, nucleus masses)."""
        lean = self.decoder == "lean"
        return lean, lean and not greedy and self.top_p < 1.0

    def _generate_rows(
        self, model, ids: Tensor, mask: Tensor, row_prompt: Tensor, eos: list[int], pad: int, greedy: bool,
        limit: int | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        """New tokens ``[R, <= max_new_tokens]`` (``limit``: at most that many) for rows ``row_prompt`` of the prompts
        ``ids``/``mask`` ``[U, P]``, their sampling log-probs (the full softmax's) and the nucleus mass kept for each
        (lean decoder, top-p < 1 and not greedy; None from ``generate``)."""
        sampling = {} if greedy else {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        new_tokens = self.max_new_tokens if limit is None else limit
        if self.decoder == "lean":
            from sgrpo.rollout.decode import decode  # imports transformers: not needed to check a config

            masses = None
            if self.sampler_reports(greedy)[1]:
                masses = torch.zeros(len(row_prompt), new_tokens, dtype=torch.float32, device=ids.device)
            tokens, logprobs = decode(
                model, ids, mask, row_prompt, new_tokens, eos, pad,
                greedy=greedy, min_new_tokens=min(self.min_new_tokens, new_tokens), cuda_graphs=self.cuda_graphs,
                graph_cache=self._graph_cache(), nucleus_mass=masses, **sampling,
            )  # fmt: skip
            return tokens, logprobs, None if masses is None else masses[:, : tokens.shape[1]]
        out = model.generate(
            input_ids=ids[row_prompt],
            attention_mask=mask[row_prompt],
            do_sample=not greedy,
            max_new_tokens=new_tokens,
            min_new_tokens=min(self.min_new_tokens, new_tokens),
            eos_token_id=eos,
            pad_token_id=pad,
            use_cache=True,
            synced_gpus=is_sharded(model) and world_size() > 1,  # FSDP2: forwards are collectives
            **sampling,
        )
        return out[:, ids.shape[1] :], None, None
