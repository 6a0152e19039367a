"""What a run shows while it runs: a progress bar counted in training steps, with reward and success rate, and one
line with the model's parameter count at the start of a fit."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled in training steps, showing reward and success rate."""

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    @property
    def total_train_batches(self) -> int | float:
        """The run's training steps (Lightning's bar counts the steps left: a resume from 3 to 6 showed 6/2)."""
        steps = self.trainer.max_steps
        return steps if steps is not None and steps > 0 else super().total_train_batches

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)  # steps done

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {key.removeprefix("train/"): value for key, value in items.items()}


class ParameterCount(Callback):
    """One line at the start of a fit: the model's class and its parameters, trainable and in all (LoRA: the
    adapters'). Lightning's summary table took 14 lines and reported 'Total FLOPs: 0' (it counts FLOPs only for
    a module with an ``example_input_array``)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        parameters = list(pl_module.model.parameters())  # FSDP2's DTensors count their global size
        total = sum(p.numel() for p in parameters)
        trainable = sum(p.numel() for p in parameters if p.requires_grad)
        count = lambda n: get_human_readable_count(n).strip()  # noqa: E731  ("132 K")
        rank_zero_info(f"{type(pl_module.model).__name__}: {count(total)} parameters, {count(trainable)} trainable")
