"""Rollouts from an FSDP2-sharded model over 2 processes, a job of tests/sharded_worker.py (``decode``, in the
joined launch of tests/test_sharded.py): the weights gathered once per rollout, through the sharded forwards, in
multi-turn episodes, and the vLLM sync's bucketed gather; checked by
``check_sharded_rollouts_sample_the_unsharded_policy``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.engine_helpers import EXAMPLES


def decode(model_dir: str, out: str) -> None:
    """Each process rolls out its own prompts from the FSDP2-sharded model, with the weights gathered once
    per rollout (the default) and through the sharded model itself (an all-gather per block per token);
    both must give the unsharded model's tokens and log-probs. Results to ``OUT/decode_rank<r>.json``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgrpo.model.loading import shard_model
    from sgrpo.rollout import HFRollout

    if not dist.is_initialized():  # run alone; after another job the group exists already
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    sharded = AutoModelForCausalLM.from_pretrained(model_dir)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    shard_model(sharded, mesh)
    results = {"gather": bucketed_gather(plain, sharded)}  # before a forward leaves the root's weights unsharded
    examples = EXAMPLES[4 * rank : 4 * rank + 4]  # different prompts per process
    forwards: list[int] = []  # forwards of the sharded model (each all-gathers every block)
    sharded.register_forward_pre_hook(lambda *_: forwards.append(1))
    for name, model, snapshot in (("plain", plain, None), ("gathered", sharded, None), ("per_token", sharded, False)):
        torch.manual_seed(rank)
        forwards.clear()
        batch = HFRollout(max_new_tokens=6, weights_snapshot=snapshot).generate(model, tokenizer, examples, 3)
        results[name] = {"ids": batch.input_ids.tolist(), "logprobs": batch.logprobs.tolist()}
        results[name]["sharded_forwards"] = len(forwards)
    results["episodes"] = sharded_episodes(plain, sharded, tokenizer, examples, rank)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"decode_rank{rank}.json").write_text(json.dumps(results))


def sharded_episodes(plain, sharded, tokenizer, examples, rank: int) -> dict:
    """Multi-turn episodes (tests/multiturn_helpers.Reply) from the sharded model on weights gathered once: each
    process runs its own number of turns, no collective per turn; through the sharded forwards, refused."""
    from sgrpo.rollout import HFRollout
    from tests.multiturn_helpers import DIGITS_TEMPLATE, Digits

    tokenizer.chat_template = DIGITS_TEMPLATE
    results = {}
    for name, model in (("plain", plain), ("gathered", sharded)):
        torch.manual_seed(10 + rank)
        batch = HFRollout(max_new_tokens=12).generate_episodes(model, tokenizer, examples, 2, Digits(max_turns=4))
        results[name] = {"ids": batch.input_ids.tolist(), "logprobs": batch.logprobs.tolist(),
                         "turns": [e.turns for e in batch.episodes]}  # fmt: skip
    try:
        HFRollout(max_new_tokens=4, weights_snapshot=False).generate_episodes(sharded, tokenizer, examples, 2, Digits())
        results["per_token"] = "ran"
    except ValueError as err:
        results["per_token"] = str(err)
    return results


def bucketed_gather(plain, sharded) -> dict:
    """The vLLM sync's gather of the sharded model: bf16, every parameter in one bucket (one collective), against
    the plain model's parameters in bf16; FSDP2 pads shards of uneven rows (the 17-token embedding over 2)."""
    import math

    import torch.distributed as dist

    from sgrpo.model.gather import ALIGN
    from sgrpo.rollout.weightsync import engine_weights

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    sizes, real = [], getattr(dist, name)
    setattr(dist, name, lambda out, inp, group=None: sizes.append(out.nbytes) or real(out, inp, group=group))
    try:
        got = dict(engine_weights(sharded, torch.bfloat16, bucket_bytes=2**30))
    finally:
        setattr(dist, name, real)
    want = {k: v.to(torch.bfloat16) for k, v in engine_weights(plain)}
    # 2 ranks, 2 bytes per value, each section padded to ALIGN bytes
    padded = 2 * sum(-(-math.ceil(v.shape[0] / 2) * v[0].numel() * 2 // ALIGN) * ALIGN for v in want.values())
    return {
        "mixed": mixed_dtype_bucket(),
        "equal": got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()),
        "dtypes": sorted({str(v.dtype) for v in got.values()}),
        "sizes": sizes,
        "padded_bytes": padded,
        "uneven": [k for k, v in want.items() if v.shape[0] % 2],
    }


def mixed_dtype_bucket() -> bool:
    """One bucket of a bf16 section of an odd element count per process (a 6-row bias over 2: 3 each) followed by
    float32 ones (LoRA's base weight and adapters travel in their own dtype): each full tensor comes out whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sgrpo.model.gather import gathered

    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)  # the same full tensors on both processes
    full = {"bias": torch.randn(6, generator=generator), "weight": torch.randn(5, 4, generator=generator),
            "odd": torch.randn(3, generator=generator, dtype=torch.float64)}  # fmt: skip
    dtypes = {"bias": torch.bfloat16, "weight": None, "odd": None}
    items = [(k, distribute_tensor(v, mesh, [Shard(0)]), dtypes[k]) for k, v in full.items()]
    got = dict(gathered(items, bucket_bytes=2**20))
    return got.keys() == full.keys() and all(torch.equal(got[k], v.to(dtypes[k] or v.dtype)) for k, v in full.items())
