"""Where samples come from: rollout engines (``HFRollout`` on the trained model itself, ``VLLMRollout`` colocated,
``VLLMServerRollout`` on vLLM servers),
the lean decoder and its CUDA graphs, and what puts the policy's weights into an engine (snapshots, weight sync).
Every engine returns the same ``RolloutBatch``; config class paths are ``sgrpo.rollout.<Engine>``."""

from sgrpo.rollout.engine import (
    RolloutEngine,
    completion_mask_until_eos,
    eos_ids,
    left_padded,
    render_prompt,
    stop_and_pad_ids,
    with_pad_token,
)
from sgrpo.rollout.hf import HFRollout
from sgrpo.rollout.vllm_engine import VLLMRollout
from sgrpo.rollout.vllm_ipc import IPCTransport
from sgrpo.rollout.vllm_launch import VLLMServers
from sgrpo.rollout.vllm_push import CPUTransport, NCCLTransport, WeightTransport
from sgrpo.rollout.vllm_server import VLLMServerRollout

__all__ = [
    "CPUTransport", "HFRollout", "IPCTransport", "NCCLTransport", "RolloutEngine", "VLLMRollout", "VLLMServerRollout",
    "VLLMServers", "WeightTransport", "completion_mask_until_eos", "eos_ids", "left_padded", "render_prompt",
    "stop_and_pad_ids", "with_pad_token",
]
