"""One-GPU smoke check of the scaling path (run through benchmarks/gpu_smoke.sh; fits in 5 minutes on one GPU).

    bash benchmarks/gpu_smoke.sh                  # ~0.44B Llama on the GPU: HF rollout, then vLLM if it imports
    bash benchmarks/gpu_smoke.sh --tiny --cpu     # the same code at toy size on CPU (seconds)

Builds a random Llama from a config (no download): hidden 1024, 24 layers, 16 heads, MLP 4096, vocabulary
32,000 (the character tokenizer of sgrpo.model.tiny padded with code points), saved to a temporary folder.
Fits ``--steps`` GRPO steps of GRPOPolicy on the synthetic sort task (with a first-character parity
reward, so groups have variance) under Lightning's ModelParallelStrategy (FSDP2, one process), bf16-mixed
with fp32 master weights and activation checkpointing; once per rollout engine (HFRollout, and
VLLMRollout when vllm imports), after a check of HFRollout's lean decoder against transformers'
``generate`` on the plain model (greedy agreement, sampled tokens/s). Prints per engine the medians
after the first (warm-up) step: rollout tokens/s, update tokens/s, and model FLOP utilisation: 2N FLOPs
per generated token and 6N per trained token (N = parameters) over the bf16 matmul peak measured here
(an 8192^3 matmul; fp32 1024^3 on CPU).
For vLLM it also checks the weight sync: the engine's copy of ``model.norm.weight`` against the
trainer's, and vLLM's sampled log-probs against the trained policy's (and the initial checkpoint's).
Prints; never asserts. Exit code 2 without a GPU (unless --cpu), 1 if a fit fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The repository root on the path, and this folder off it (benchmarks/estimators.py would shadow the package).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

SIZES = {
    "full": {"hidden": 1024, "layers": 24, "heads": 16, "mlp": 4096, "vocab": 32000, "prompts": 32, "group": 8,
             "new_tokens": 256, "positions": 1024},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "mlp": 256, "vocab": 64, "prompts": 4, "group": 4,
             "new_tokens": 8, "positions": 64},
}  # fmt: skip
KEYS = {
    "step_s": "train/time/step_s",
    "rollout_s": "train/time/rollout_s",
    "rollout_tok_s": "train/throughput/rollout_tok_s",
    "update_tok_s": "train/throughput/update_tok_s",
    "length": "train/completion/length_mean",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (hidden 64, 2 layers, 4 prompts x 4 x 8 tokens)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (fp32); vLLM is skipped")
    parser.add_argument("--engine", choices=("auto", "hf", "vllm"), default="auto", help="auto: hf, then vllm if any")
    parser.add_argument("--steps", type=int, default=4, help="fit steps per engine; the first is warm-up")
    parser.add_argument("--lr", type=float, default=3e-4, help="large enough that the sync check sees the update")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    return parser.parse_args(argv)


def require_device(cpu: bool) -> None:
    if cpu or torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    print(
        f"error: no CUDA GPU visible (torch {torch.__version__} is {build}). Run this on a GPU machine "
        "(on a CUDA machine: make TORCH_SPEC='torch==2.13.0' install), or pass --tiny --cpu for the CPU check.",
        file=sys.stderr,
    )
    sys.exit(2)


def build_model(path: Path, size: dict) -> int:
    """Save a random Llama and its character tokenizer (padded to ``vocab`` tokens) at ``path``; return N."""
    from sgrpo.model.tiny import SYNTHETIC_CHARS, build_char_tokenizer, build_tiny_llama

    extra = (chr(c) for c in range(0x100, 0x110000) if not 0xD800 <= c < 0xE000)
    chars = SYNTHETIC_CHARS + "".join(next(extra) for _ in range(size["vocab"] - 3 - len(SYNTHETIC_CHARS)))
    tokenizer = build_char_tokenizer(chars)
    model = build_tiny_llama(
        tokenizer, size["hidden"], size["layers"], size["heads"], size["mlp"], max_positions=size["positions"]
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def matmul_peak(device: torch.device) -> float:
    """Best matmul rate (FLOP/s): bf16 8192^3 on a GPU, fp32 1024^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # warm-up first
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def fit(engine_name: str, model_dir: Path, size: dict, args, root: Path) -> dict:
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from estimators import SoftmaxGRPO
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from sgrpo.train.loss import ClippedSurrogate
    from tasks.base import Reward, RewardResult
    from tasks.synthetic import SyntheticTask

    class Parity(Reward):
        """1 if the first character's code point is odd: a binary reward with variance for a random model."""

        name = "parity"

        def score(self, examples, completions) -> RewardResult:
            total = torch.tensor([float(ord((c or "0")[0]) % 2) for c in completions], dtype=torch.float32)
            return RewardResult(total, {self.name: total})

    class Recorder(Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.checks: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            metrics = trainer.callback_metrics
            self.steps.append({k: float(metrics[v]) for k, v in KEYS.items() if v in metrics})

        def on_train_end(self, trainer, pl_module) -> None:
            if engine_name == "vllm":
                try:  # a failed check is reported, the throughput numbers are kept
                    self.checks = sync_checks(pl_module, model_dir, size, trainer.precision_plugin.forward_context)
                except Exception as err:
                    self.checks = {"error": f"{type(err).__name__}: {err}"}

    if engine_name == "hf":
        rollout = HFRollout(max_new_tokens=size["new_tokens"])
    else:
        from sgrpo.rollout.vllm_engine import VLLMRollout

        rollout = VLLMRollout(
            max_new_tokens=size["new_tokens"],
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=size["positions"],
            enforce_eager=True,  # skip CUDA-graph capture and compilation: startup fits the 5-minute budget
        )
    policy = GRPOPolicy(
        model=str(model_dir),
        task=SyntheticTask(kind="sort", num_train=4 * size["prompts"], num_validation=0, num_test=0, reward=Parity()),
        estimator=SoftmaxGRPO(temperature=0.5),
        rollout=rollout,
        group_size=size["group"],
        prompts_per_step=size["prompts"],
        loss=ClippedSurrogate(aggregation="token_mean"),
        activation_checkpointing=True,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True),  # as the recipes
        export_dir=str(root / f"export_{engine_name}"),
    )
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu" if args.cpu else "gpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        precision="32-true" if args.cpu else "bf16-mixed",
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        default_root_dir=str(root / engine_name),
    )
    trainer.fit(policy)
    return {"steps": recorder.steps, "checks": recorder.checks}


@torch.no_grad()
def sync_checks(policy, model_dir: Path, size: dict, autocast) -> dict:
    """Engine vs trainer after training: one parameter, and the sampled tokens' log-probs (trainer in ``autocast``)."""
    from transformers import AutoModelForCausalLM

    from sgrpo.model.logprobs import completion_logprobs, logprob_mismatch
    from sgrpo.train.loss import tis_weights

    engine, model = policy.rollout, policy.model
    examples = list(policy.task.examples("train"))[: size["prompts"]]
    batch = engine.generate(model, policy.tokenizer, examples, size["group"])  # syncs the trained weights
    norm = model.model.norm.weight
    trainer_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().cpu()
    engine_norm = engine._llm.apply_model(lambda m: dict(m.named_parameters())["model.norm.weight"].float().cpu())[0]
    initial = AutoModelForCausalLM.from_pretrained(model_dir).to(batch.input_ids.device)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, engine.temperature)
    with autocast():
        trained_logp, _ = completion_logprobs(model, *args)
        initial_logp, _ = completion_logprobs(initial, *args)
    mask = batch.completion_mask
    cap = policy.loss.importance_sampling_cap or 2.0
    weights = tis_weights(trained_logp, batch.logprobs, mask, cap)
    return {
        "norm_weight_max_abs_diff": (trainer_norm - engine_norm).abs().max().item(),
        "norm_weight_moved_by_training": (trainer_norm - initial.model.norm.weight.float().cpu()).abs().max().item(),
        "logprob_vs_trained": {k: v.item() for k, v in logprob_mismatch(trained_logp, batch.logprobs, mask).items()},
        "logprob_vs_initial": {k: v.item() for k, v in logprob_mismatch(initial_logp, batch.logprobs, mask).items()},
        "tis_weight_mean": weights[mask].mean().item(),
        "tis_capped_fraction": (weights[mask] >= cap - 1e-6).float().mean().item(),
    }


def summarise(result: dict, n_params: int, peak: float, rows: int) -> dict:
    steps = result["steps"][1:] or result["steps"]  # drop the warm-up step when there is more than one
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    generated = med("length") * rows  # trained tokens = generated tokens (token_mean, nothing masked)
    return {
        "steps": len(steps),
        "step_s": med("step_s"),
        "rollout_s": med("rollout_s"),
        "rollout_tok_s": med("rollout_tok_s"),
        "update_tok_s": med("update_tok_s"),
        "rollout_mfu": 2 * n_params * med("rollout_tok_s") / peak,
        "update_mfu": 6 * n_params * med("update_tok_s") / peak,
        "step_mfu": 8 * n_params * generated / (med("step_s") * peak),
    }


def decoder_check(model_dir: Path, size: dict, device: torch.device) -> dict:
    """HFRollout's lean decoder against transformers' generate on the plain model (no FSDP).

    Greedy agreement (share of rows whose tokens are identical; bf16 ties may flip a few) on a quarter
    of the prompts, then one sampled full-size rollout with each: seconds and tokens/s.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks._workload import Workload, make_task
    from sgrpo.rollout import HFRollout
    from sgrpo.rollout.decode import LlamaFamilyStep

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = list(make_task(Workload(model_dir=str(model_dir), prompts=size["prompts"])).examples("train"))
    out = {"native_step": LlamaFamilyStep.supported(model)}
    few = examples[: max(1, len(examples) // 4)]
    variants = {"lean": {}, "generate": {"decoder": "generate"}, "graphs": {"cuda_graphs": True}}
    greedy = {
        name: HFRollout(max_new_tokens=size["new_tokens"], **kw).generate(model, tokenizer, few, 2, greedy=True)
        for name, kw in variants.items()
    }
    for other, key in (("generate", "greedy_rows_identical"), ("graphs", "graphs_greedy_rows_identical")):
        width = min(b.input_ids.shape[1] for b in (greedy["lean"], greedy[other]))
        same = (greedy["lean"].input_ids[:, :width] == greedy[other].input_ids[:, :width]).all(-1)
        out[key] = float(same.float().mean())
    gap = None  # greedy log-probs at T = 1 of the same tokens: the graph path's numerics against the eager one's
    if out["graphs_greedy_rows_identical"] == 1:
        gap = float((greedy["graphs"].logprobs - greedy["lean"].logprobs).abs().max())
    out["graphs_logprob_max_gap"] = gap
    for name, kw in variants.items():
        rollout = HFRollout(max_new_tokens=size["new_tokens"], **kw)

        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        batch = rollout.generate(model, tokenizer, examples, size["group"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        out[f"{name}_s"] = elapsed
        out[f"{name}_tok_s"] = float(batch.completion_mask.sum()) / elapsed
    out |= kept_graphs_check(model, tokenizer, few, size["new_tokens"])
    del model
    return out


def kept_graphs_check(model, tokenizer, examples, new_tokens: int) -> dict:
    """CUDA graphs kept across rollouts (``GraphCache``): one greedy rollout, the weights changed in place (as an
    optimiser step does), another through the kept graphs; its rows against the eager decoder's on the new weights
    (identical share), and how many graphs the second rollout captured (0: all replayed)."""
    from sgrpo.rollout import HFRollout

    kept = HFRollout(max_new_tokens=new_tokens, cuda_graphs=True)
    kept.generate(model, tokenizer, examples, 2, greedy=True)
    cache = kept._graphs
    captured = cache.captures if cache is not None else 0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.05)  # in place: the addresses the graphs read stay
    again = kept.generate(model, tokenizer, examples, 2, greedy=True)
    eager = HFRollout(max_new_tokens=new_tokens).generate(model, tokenizer, examples, 2, greedy=True)
    width = min(again.input_ids.shape[1], eager.input_ids.shape[1])
    same = (again.input_ids[:, :width] == eager.input_ids[:, :width]).all(-1)
    return {"graphs_kept_rows_identical": float(same.float().mean()),
            "graphs_kept_second_captures": (cache.captures - captured) if cache is not None else None}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    require_device(args.cpu)
    torch.manual_seed(0)
    size = SIZES["tiny" if args.tiny else "full"]
    device = torch.device("cpu" if args.cpu else "cuda")
    engines = ["hf"] if args.engine in ("auto", "hf") else []
    has_vllm = importlib.util.find_spec("vllm") is not None
    if args.engine == "vllm" or (args.engine == "auto" and has_vllm and not args.cpu):
        engines.append("vllm")
    elif args.engine == "auto":
        print("vLLM: skipped (" + ("needs a GPU" if args.cpu else "not installed: pip install -e '.[vllm]'") + ")")
    with tempfile.TemporaryDirectory(prefix="sgrpo_smoke_") as tmp:
        root = Path(tmp)
        n_params = build_model(root / "model", size)
        peak = matmul_peak(device)
        rows = size["prompts"] * size["group"]
        where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(
            f"device: {where}; model: {n_params / 1e6:.1f}M parameters; {size['prompts']} prompts x {size['group']} "
            f"completions x {size['new_tokens']} new tokens; peak {'bf16' if device.type == 'cuda' else 'fp32'} "
            f"matmul {peak / 1e12:.3f} TFLOP/s"
        )
        status = 0
        try:
            check = decoder_check(root / "model", size, device)
            print(
                f"decoders: lean {check['lean_tok_s']:.0f} tok/s vs generate {check['generate_tok_s']:.0f} tok/s "
                f"({check['generate_s'] / check['lean_s']:.2f}x); greedy rows identical "
                f"{check['greedy_rows_identical']:.0%}; native Llama step {'on' if check['native_step'] else 'off'}"
            )
            gap = "n/a" if check["graphs_logprob_max_gap"] is None else f"{check['graphs_logprob_max_gap']:.2e}"
            speedup = check["lean_s"] / check["graphs_s"]
            print(
                f"graphs: fixed-shape steps {check['graphs_tok_s']:.0f} tok/s ({speedup:.2f}x lean; CUDA graphs on "
                f"a GPU, eager elsewhere); greedy rows identical to lean {check['graphs_greedy_rows_identical']:.0%}; "
                f"max log-prob gap {gap}"
            )
            print(
                f"kept graphs: after an in-place weight change, greedy rows identical to lean "
                f"{check['graphs_kept_rows_identical']:.0%}; graphs captured by the second rollout "
                f"{check['graphs_kept_second_captures']}"
            )
        except Exception as err:  # report and go on to the fits
            print(f"decoders: FAILED: {type(err).__name__}: {err}")
            status = 1
        for name in engines:
            started = time.perf_counter()
            try:
                result = fit(name, root / "model", size, args, root)
            except Exception as err:  # report and go on to the next engine
                print(f"{name}: FAILED: {type(err).__name__}: {err}")
                status = 1
                continue
            summary = summarise(result, n_params, peak, rows) | {"wall_s": time.perf_counter() - started}
            print(
                f"{name}: rollout {summary['rollout_tok_s']:.0f} tok/s (MFU {summary['rollout_mfu']:.1%}), "
                f"update {summary['update_tok_s']:.0f} tok/s (MFU {summary['update_mfu']:.1%}), "
                f"step {summary['step_s']:.2f} s (MFU {summary['step_mfu']:.1%}), "
                f"{summary['steps']} measured steps, {summary['wall_s']:.0f} s wall"
            )
            print(f"{name} summary: " + json.dumps(summary | ({"sync": result["checks"]} if result["checks"] else {})))
        if device.type == "cuda":
            peak_gib = torch.cuda.max_memory_allocated() / 2**30
            print(f"torch peak allocated: {peak_gib:.1f} GiB (vLLM's memory pool not counted)")
    return status


if __name__ == "__main__":
    sys.exit(main())
