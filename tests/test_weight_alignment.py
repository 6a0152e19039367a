"""Every CPU weight sgrpo loads lives in memory of its own, 64-byte aligned (``sgrpo.model.loading.own_weights``):
transformers hands out the safetensors map's tensors at 8-byte aligned offsets, and the CPU BLAS computes a one-row
product in another order there than on an aligned copy of the same weights (seen on AMD EPYC: the rollout snapshot
under FSDP2 and the async producer then sampled other log-probs than the synchronous run)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from estimators import GRPO
from sgrpo.model.loading import WEIGHT_ALIGNMENT, load_causal_lm, own_weights
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.types import Example
from tasks.synthetic import SyntheticTask

SHIPPED = Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model"  # trained: it ends rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


def unaligned(model: torch.nn.Module) -> list[str]:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, t in tensors if t.device.type == "cpu" and t.data_ptr() % WEIGHT_ALIGNMENT]


def test_the_policy_and_the_loader_own_aligned_weights_with_ties_and_values_kept(model_dir):
    mapped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if not unaligned(mapped):
        pytest.skip("this transformers copies the weights it loads: nothing to align")
    loaded = load_causal_lm(str(model_dir), torch.float32)
    assert unaligned(loaded) == []
    assert all(torch.equal(a, b) for a, b in zip(mapped.state_dict().values(), loaded.state_dict().values()))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # the tiny model ties its head: still one
    assert own_weights(loaded) == 0  # nothing left to move
    # a model bound for an accelerator keeps the file's map, shared by a machine's processes until each moves it
    assert unaligned(load_causal_lm(str(model_dir), torch.float32, "cuda")) == unaligned(mapped)

    task = SyntheticTask(kind="sort", levels=[3], num_train=8, num_validation=2)
    policy = GRPOPolicy(str(model_dir), task, GRPO(), HFRollout(max_new_tokens=4), group_size=2)
    policy.configure_model()
    assert unaligned(policy.model) == []


def test_the_weight_snapshot_samples_the_loaded_models_log_probs_bit_for_bit():
    """A copy of the weights (``RolloutWeights``: FSDP2's rollout, and like it the producer's model) samples what
    the loaded model samples, log-probs included, also at decode steps with one row left (one-row products)."""
    model = load_causal_lm(str(SHIPPED), torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    plain, snapshot = HFRollout(max_new_tokens=8), HFRollout(max_new_tokens=8, weights_snapshot=True)
    rng, one_row_steps = random.Random(0), 0
    for trial in range(12):
        examples = [Example("sort: " + "".join(rng.choices("abcdefghij", k=rng.randint(2, 8))), "x") for _ in range(2)]
        batches = []
        for engine in (plain, snapshot):
            torch.manual_seed(trial)
            batches.append(engine.generate(model, tokenizer, examples, 4))
        assert torch.equal(batches[0].input_ids, batches[1].input_ids)
        assert torch.equal(batches[0].logprobs, batches[1].logprobs), trial
        lengths = batches[0].completion_mask.sum(1)
        one_row_steps += int((lengths == lengths.max()).sum() == 1)
    assert one_row_steps >= 3  # the case at stake ran: a last decode step with one row
