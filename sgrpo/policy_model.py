"""The policy's model: its tokenizer, its weights (LoRA, lean layers, sharding) and the prompts it has room for."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from sgrpo.checks import require
from sgrpo.distributed import defers_gradient_sync
from sgrpo.model.head import check_logit_head
from sgrpo.model.lean_mlp import apply_lean_mlp
from sgrpo.model.lean_norm import apply_lean_norm
from sgrpo.model.loading import (
    disable_dropout,
    frequency_buffers,
    keep_frequencies,
    load_causal_lm,
    resolve_model_path,
    shard_model,
)
from sgrpo.model.lora import apply_lora
from sgrpo.rollout.engine import bump_weights_version, with_pad_token
from sgrpo.rollout.episodes import multi_turn_problem, opening_text
from sgrpo.rollout.prompt_limits import prompt_limit, within_limit
from sgrpo.train.reference import build_reference
from sgrpo.types import Example

#: the splits a trainer entry point reads (a fit's validation only where its trainer validates)
STAGE_SPLITS = {"fit": ("train", "validation"), "validate": ("validation",), "test": ("test",)}
SPLIT_LIMITS = {"validation": "limit_val_batches", "test": "limit_test_batches"}


class PolicyModel:
    """Mixin of ``GRPOPolicy``: ``configure_model`` loads the tokenizer, screens the prompts of the splits this
    trainer entry point reads against the prompt limit, then loads the weights. So a split whose every prompt is
    over the limit is refused in one line (``ConfigError``) before the weights load, not after; the screened
    splits are kept for the data loaders, so each prompt is tokenized once."""

    _screened: dict[str, tuple[Sequence[Example], int]]  # split -> (examples within the limit, how many dropped)

    def configure_model(self) -> None:
        precision = self._trainer.precision_plugin.precision if self._trainer is not None else "32-true"
        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None  # FSDP2 (ModelParallel)
        gather = torch.bfloat16 if mesh is not None and precision == "bf16-mixed" else None  # its blocks' dtype
        if self.model is None:
            self._load_model(mesh, gather)
            bump_weights_version(self.model)  # known weights: an engine holding a copy syncs once until they change
        # the KL reference for fits only (validate, test never use it); LoRA: the policy, adapters off (train.reference)
        if self.loss.needs_reference and self.peft is None and self._reference is None and not self._evaluating():
            self.__dict__["_reference"] = build_reference(self.model, precision, gather, mesh)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (every ``to``, ``half``, ``cuda``), RoPE's frequencies kept in float32 where it converts
        the policy to half precision (``keep_frequencies``: Lightning's ``bf16-true`` and ``16-true`` convert so)."""
        model = self._modules.get("model")
        kept = frequency_buffers(model) if model is not None else []
        result = super()._apply(fn, recurse)
        keep_frequencies(kept)
        return result

    def _stage(self) -> str | None:  # the trainer's entry point: fit, validate, test (None: no trainer)
        fn = getattr(getattr(self._trainer, "state", None), "fn", None)
        return getattr(fn, "value", fn)

    def _evaluating(self) -> bool:  # the trainer runs ``validate`` or ``test`` (not a fit or its validations)
        return self._stage() in ("validate", "test")

    def _load_model(self, mesh, gather: torch.dtype | None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        dtype = getattr(torch, self.model_dtype)
        path = resolve_model_path(self.model_path)
        self.tokenizer = with_pad_token(AutoTokenizer.from_pretrained(path))  # none: EOS pads
        self.task.adapt_to_tokenizer(self.tokenizer)  # e.g. DeepMath requires </think> if the template opens <think>
        if self.environment is not None:  # refused here, before the weights load, in one line
            self.environment.adapt_to_tokenizer(self.tokenizer)
            problem = multi_turn_problem(self.tokenizer, self.environment, self.task.chat_template_kwargs)
            require(problem is None, f"model.environment: {self.environment.name} needs a multi-turn chat template, "
                    f"but {path}: {problem}; use a model whose chat template renders tool and user turns")  # fmt: skip
        self._screen_prompts(AutoConfig.from_pretrained(path))  # the model's config, as the loaded model's
        device = getattr(getattr(self._trainer, "strategy", None), "root_device", "cpu")  # where the model computes
        self.model = load_causal_lm(path, dtype, device)
        if self.peft is not None:
            apply_lora(self.model, self.peft)  # only the adapters train
        if not self.keep_dropout:
            disable_dropout(self.model)
        check_logit_head(self.model)  # refuses a model whose logits the loss would compute wrongly
        self.model.train()
        if self.lean_mlp:
            apply_lean_mlp(self.model)  # LoRA'd or hooked projections take the module's own forward at each call
        if self.lean_norm:
            apply_lean_norm(self.model)
        if self.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mesh is not None:
            shard_model(self.model, mesh, gather)
            device = self.trainer.strategy.root_device
            self.defer_gradient_sync = defers_gradient_sync(self.gradient_sync, self.model, device)

    def _screen_prompts(self, config: Any) -> None:
        """The prompts within the limit of each split this entry point reads (``STAGE_SPLITS``; an evaluation split
        where the trainer's ``limit_val_batches`` or ``limit_test_batches`` is not 0, as
        ``run.preflight.needed_splits``), ``config`` giving the model's positions."""
        for split in STAGE_SPLITS.get(self._stage(), ()):
            limit = SPLIT_LIMITS.get(split)  # a trainer limited to 0 batches of a split runs no loop over it
            if limit is None or getattr(self._trainer, limit, 1.0) != 0:
                self._screened[split] = self._screen(split, config)

    def _within_prompt_limit(self, split: str) -> tuple[Sequence[Example], int]:
        """The examples of ``split`` whose prompt fits the prompt limit, and how many were dropped (screened once)."""
        if split not in self._screened:  # a model given loaded (or a split its entry point does not name)
            self._screened[split] = self._screen(split, getattr(self.model, "config", None))
        return self._screened[split]

    def _screen(self, split: str, config: Any) -> tuple[Sequence[Example], int]:
        key = "rollout" if split == "train" else "val_rollout"  # the engine that samples this split
        engine = getattr(self, key)
        limit = prompt_limit(config, self.max_prompt_tokens, engine.max_new_tokens, engine.max_total_tokens, key)
        env = self.environment  # episodes start from the environment's opening: the screen measures that
        opening = None if env is None else partial(opening_text, self.tokenizer, environment=env)
        return within_limit(self.task.examples(split), self.tokenizer, limit, split, opening)
