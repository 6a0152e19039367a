"""The LM head's bf16 path (``torch.mm(..., out_dtype=torch.float32)``, the activation in two bf16 parts) against
float32: speed, peak memory and log-prob differences of token log-probs, forward and backward.

    python benchmarks/head_dtype.py                    # on a GPU: a 1.5B model's head (H 1,536, V 151,936)
    python benchmarks/head_dtype.py --device cpu --tiny  # the same code at toy size (no out_dtype matmul on CPU)

Paths, each over the same hidden states ``h`` ``[M, H]`` (float32) and weight ``W`` ``[V, H]`` (float32 master):

* ``fp32``: sgrpo's head at 32-true (``TokenLogprobs`` in float32), the reference;
* ``bf16``: sgrpo's head under bf16-mixed: ``W`` rounded to bf16 once, ``[hi, lo] @ [W; W]`` with a float32
  result (one GEMM; on CPU the same product in float32), the backward's ``grad_W`` accumulated in float32;
* ``bf16_one_part``: what a plain autocast head computes, ``h`` rounded to one bf16 part (for comparison).

For each: seconds per forward + backward (median of ``--repeats``), peak memory (CUDA), and the log-probs'
difference from ``fp32`` (max and mean absolute). ``on-policy gap``: the sampler's logits (``LMHead``, what the
rollout samples from) against the loss's forward (``TokenLogprobs``) at bf16: the same head, so 0 up to float
summation order. Prints one line per path and the ratios to ``fp32``; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgrpo.model.head import LMHead, LogitTransform, TokenLogprobs, _fp32_output  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="H 64, V 1,000, 256 tokens")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=4096, help="completion tokens M")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per logits chunk (sgrpo's GPU default)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.vocab, args.tokens, args.chunk = 64, 1000, 256, 64
    return args


def logprobs(path: str, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token log-probs ``[M]`` of ``targets`` by ``path`` (differentiable in ``h`` and ``weight``)."""
    if path == "bf16_one_part":
        logits = (h.to(torch.bfloat16) @ weight.to(torch.bfloat16).t()).float()
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    logp, _ = TokenLogprobs.apply(h, weight, None, targets, 1.0, chunk, False, LogitTransform(), dtype)
    return logp


def timed(path: str, h, weight, targets, chunk: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of a forward + backward, and the peak memory in GiB (CUDA; else nan)."""
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        h.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        logprobs(path, h, weight, targets, chunk).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times[1:]), peak


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu --tiny for the CPU check", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(device).requires_grad_()
    h = torch.randn(args.tokens, args.hidden, generator=generator).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(device)
    real = _fp32_output(device.type, torch.bfloat16)
    print(f"head: H {args.hidden}, V {args.vocab}, {args.tokens} tokens, chunks of {args.chunk}; {device}; "
          f"torch.mm(bf16, bf16, out_dtype=float32) {'used' if real else 'absent: float32 emulation'}")  # fmt: skip
    with torch.no_grad():
        reference = logprobs("fp32", h, weight, targets, args.chunk)
    rows = {}
    for path in ("fp32", "bf16", "bf16_one_part"):
        seconds, peak = timed(path, h, weight, targets, args.chunk, args.repeats, device)
        with torch.no_grad():
            gap = (logprobs(path, h, weight, targets, args.chunk) - reference).abs()
        rows[path] = seconds
        print(f"{path:14s} {seconds * 1e3:9.2f} ms fwd+bwd  peak {peak:6.2f} GiB  |logp - fp32| max "
              f"{gap.max().item():.2e} mean {gap.mean().item():.2e}")  # fmt: skip
    print("ratios to fp32: " + ", ".join(f"{p} {rows[p] / rows['fp32']:.2f}x" for p in rows if p != "fp32"))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        sampler = LMHead(weight, None)(h).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        trainer = logprobs("bf16", h, weight, targets, args.chunk)
    print(f"on-policy gap (sampler's LMHead vs the loss's TokenLogprobs, bf16): max "
          f"{(sampler - trainer).abs().max().item():.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
