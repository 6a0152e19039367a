"""LoRA over 2 processes (FSDP2 and DDP) in the joined launch of tests/test_sharded.py: the jobs (``lora_jobs``)
and their check."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from sgrpo.export import main as export
from tests.sharded_worker import probe

SHIPPED = Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model"  # trained: its rewards vary


#: LoRA under FSDP2 and under DDP, each with a KL (its reference: the policy with its adapters off)
LORA_RUNS = {"fsdp2": ["--model.loss.init_args.kl_coef=0.001"],
             "ddp": ["--trainer.strategy=ddp", "--model.loss.init_args.kl_coef=0.001"]}  # fmt: skip


def lora_jobs(tmp_path: Path) -> list[list[str]]:
    """2 steps of each LoRA run, then its resume to 3 from the adapter-only checkpoint (the shipped model, whose
    rewards vary: the random tiny model's are all 0, nothing would train)."""
    fits = []
    for strategy, extra in LORA_RUNS.items():
        root = str(tmp_path / "lora" / strategy)
        fits += [["fit", root, str(SHIPPED), "2", "", "--model.peft.rank=4", *extra],
                 ["fit", root, str(SHIPPED), "3", "last", "--model.peft.rank=4", *extra]]  # fmt: skip
    return fits


def check_lora_fits_over_two_processes_resumes_and_exports_the_adapter(tmp_path: Path) -> None:
    """LoRA under FSDP2 (adapters sharded with their blocks, gathered for the weight snapshot and the export)
    and under DDP: 2 steps each, resumed to 3 from the adapter-only checkpoint, a PEFT adapter folder that
    reproduces the trained policy. With a KL, whose reference is the policy with its adapters off (no second
    model): the adapters must still train after each reference pass."""
    from peft import PeftModel
    from safetensors.torch import load_file

    for strategy in LORA_RUNS:
        root = tmp_path / "lora" / strategy
        # python -m sgrpo.export from the checkpoint, in one process: FSDP2's is a sharded folder of the whole
        # model (the shards gathered), DDP's a file of the adapters
        export([str(root / "checkpoints" / "last.ckpt"), str(root / "exported")])
        assert (root / "checkpoints" / "last.ckpt").is_dir() == (strategy == "fsdp2")
        for folder in (root / "hf_model", root / "exported"):
            exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SHIPPED), folder)
            want = torch.load(root / "probe_logprobs.pt")
            torch.testing.assert_close(probe(exported), want, atol=1e-6, rtol=1e-6, msg=f"{strategy}: {folder}")
        trained = load_file(root / "hf_model" / "adapter_model.safetensors")  # lora_B starts at 0
        assert all(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), strategy
