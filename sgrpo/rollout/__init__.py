"""Where samples come from: rollout engines (``HFRollout`` on the trained model itself, ``VLLMRollout`` colocated),
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

__all__ = [
    "HFRollout", "RolloutEngine", "VLLMRollout", "completion_mask_until_eos", "eos_ids", "left_padded",
    "render_prompt", "stop_and_pad_ids", "with_pad_token",
]
