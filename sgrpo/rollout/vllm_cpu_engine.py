"""The server side of sgrpo's CPU weight transport: a vLLM ``WeightTransferEngine`` that loads safetensors files.

Runs inside the vLLM server's workers (imported by vLLM when the server uses the ``sgrpo_cpu`` backend, see
``sgrpo.rollout.vllm_plugin``). The trainer (``sgrpo.rollout.vllm_push.CPUTransport``) writes each chunk of the
policy's weights (HF names, the server's dtype) to a file both can read and posts its path to ``/update_weights``;
this engine loads it with vLLM's layerwise reload, the same steps as the colocated engine
(``sgrpo.rollout.weightsync.begin_reload`` / ``load_chunk`` / ``end_reload``: repacked CPU weights and tied LM heads
refreshed). The trainer deletes the file once every server has loaded it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from sgrpo.rollout.weightsync import begin_reload, end_reload, load_chunk


@dataclass
class CPUTransferInitInfo(WeightTransferInitInfo):
    """Nothing to set up: files carry the weights."""


@dataclass
class CPUTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: a safetensors file of (HF name -> tensor)."""

    path: str


class CPUWeightTransferEngine(WeightTransferEngine[CPUTransferInitInfo, CPUTransferUpdateInfo]):
    """Loads each posted safetensors chunk into the served model (vLLM's layerwise reload)."""

    init_info_cls = CPUTransferInitInfo
    update_info_cls = CPUTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: set[str] = set()

    def init_transfer_engine(self, init_info: CPUTransferInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self.loaded = set()
        begin_reload(self.model, self.vllm_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU: nothing to synchronize

    def receive_weights(self, update_info: CPUTransferUpdateInfo) -> None:
        tensors = load_file(update_info.path, device="cpu")
        chunk = [(name, value.to(self.device)) for name, value in tensors.items()]
        self.loaded |= load_chunk(self.model, chunk, self.vllm_config)

    def finish_weight_update(self) -> None:
        end_reload(self.model, self.vllm_config)
        expected = {name for name, _ in self.model.named_parameters()}
        missing = sorted(expected - self.loaded) if self.loaded else []
        if missing:
            raise RuntimeError(
                f"{len(missing)} served parameters got no value from the trainer, e.g. {missing[:5]}: the trainer's "
                "parameter names do not map to this model's checkpoint names (sgrpo.rollout.weightsync)"
            )

    def shutdown(self) -> None:
        self.loaded = set()  # nothing else held: the files are the trainer's
