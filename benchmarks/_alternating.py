"""The parent's side of ``benchmarks/throughput.py`` (split from it): the model folder both frameworks load, the
matmul peak the FLOP fractions are taken against, the worker processes (``benchmarks/_workload.py``, one
framework each) whose steps it releases alternately, one at a time, and the medians and tables of their records.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._workload import PREFIX, Workload

#: the script a worker process runs (``--worker FRAMEWORK --work JSON``)
SCRIPT = Path(__file__).resolve().with_name("throughput.py")


# ---------------------------------------------------------------------------------------------- setup
def build_model(
    path: Path, vocab: int | None, hidden: int, layers: int, heads: int, intermediate: int, positions: int
) -> tuple[int, int]:
    """Save a random char-level Llama (vocabulary padded to ``vocab`` with extra characters): (N, vocab)."""
    from sgrpo.model.tiny import SYNTHETIC_CHARS, build_char_tokenizer, build_tiny_llama

    chars = SYNTHETIC_CHARS
    if vocab is not None:  # code points from U+0100 up, surrogates skipped: one token each
        extra = (chr(c) for c in range(0x100, 0x110000) if not 0xD800 <= c < 0xE000)
        chars += "".join(next(extra) for _ in range(vocab - 3 - len(SYNTHETIC_CHARS)))
    tokenizer = build_char_tokenizer(chars)
    model = build_tiny_llama(tokenizer, hidden, layers, heads, intermediate, max_positions=positions)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), len(tokenizer)


def matmul_peak(threads: int, n: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """Best matmul rate (FLOP/s): fp32 at ``threads`` threads on CPU, bf16 8192^3 on a GPU."""
    import torch

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    n = 8192 if cuda else n
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# -------------------------------------------------------------------------------------------- workers
class Worker:
    """One framework's process: release a step with ``go``, read its ``@@bench`` record back."""

    def __init__(self, framework: str, work: Workload, cap_gib: float) -> None:
        self.framework, self.cap = framework, cap_gib * 2**30
        # stderr goes to a file that lives as long as the worker (read back when it fails)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{framework}_", suffix=".log")  # noqa: SIM115
        env = os.environ | {"OMP_NUM_THREADS": str(work.threads), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, str(SCRIPT), "--worker", framework, "--work", work.to_json()]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=self.log, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.error: str | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.lines.put(line[len(PREFIX) :])
        self.lines.put(None)

    def record(self) -> dict | None:
        """The next record; None (and ``error`` set) if the process died or went over the memory cap."""
        import psutil

        process = psutil.Process(self.proc.pid)
        while self.error is None:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                try:
                    if process.memory_info().rss > self.cap:
                        self.proc.kill()
                        self.error = f"OOM: RSS above the {self.cap / 2**30:.0f} GiB cap, killed"
                except psutil.NoSuchProcess:
                    pass
                continue
            if line is None:
                self.proc.wait()
                self.error = f"exited with code {self.proc.returncode}: {self._tail()}"
            else:
                record = json.loads(line)
                if "error" in record:
                    self.error = record["error"]
                return record if self.error is None else None
        return None

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close(self) -> None:
        self.send("quit")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def _tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return " | ".join(lines[-3:]) if lines else "(no stderr)"


def run_alternating(entries: list[tuple[str, Workload]], warmup: int, cap_gib: float) -> list[dict]:
    """Start one worker per (framework, workload), release their steps alternately; per entry: records."""
    workers = [Worker(framework, work, cap_gib) for framework, work in entries]
    results = [{"setup": w.record(), "steps": []} for w in workers]
    for step in range(max(work.steps for _, work in entries)):
        for w, result in zip(workers, results):
            if w.error or step >= entries[workers.index(w)][1].steps:
                continue
            w.send("go")
            record = w.record()
            if record is not None and step >= warmup:
                result["steps"].append(record)
    for w, result in zip(workers, results):
        w.close()
        result["error"] = w.error
    return results


# -------------------------------------------------------------------------------------------- reports
def summarise(result: dict, n_params: int, peak: float, rows: int) -> dict | None:
    """Medians over the measured steps of each per-step figure (tokens generated = tokens trained)."""
    steps = result["steps"]
    if not steps:
        return None
    per_step = [
        {
            "step_s": s["wall_s"],
            "cpu_s": s["cpu_s"],
            "rollout_s": s["gen_s"],
            "update_s": s["wall_s"] - s["gen_s"],
            "rollout_tok_s": s["gen_tokens"] / s["gen_s"],
            "update_tok_s": s["gen_tokens"] / (s["wall_s"] - s["gen_s"]),
            "mean_len": s["gen_tokens"] / rows,
            "flop_frac": (2 + 6) * n_params * s["gen_tokens"] / (s["wall_s"] * peak),
            "rollout_flop_frac": 2 * n_params * s["gen_tokens"] / (s["gen_s"] * peak),
            "update_flop_frac": 6 * n_params * s["gen_tokens"] / ((s["wall_s"] - s["gen_s"]) * peak),
        }
        for s in steps
    ]
    summary = {key: statistics.median(p[key] for p in per_step) for key in per_step[0]}
    summary["best_step_s"] = min(p["step_s"] for p in per_step)
    summary["peak_mib"] = max(s["peak_mib"] for s in steps)
    summary["setup_rss_mib"] = result["setup"]["rss_mib"] if result["setup"] else float("nan")
    return summary


ROWS = [
    ("median step time (s)", "step_s", "{:.3f}"),
    ("best step time (s)", "best_step_s", "{:.3f}"),
    ("median process CPU time per step (s)", "cpu_s", "{:.3f}"),
    ("rollout: time in generate (s)", "rollout_s", "{:.3f}"),
    ("update: rest of the step (s)", "update_s", "{:.3f}"),
    ("rollout tokens/s", "rollout_tok_s", "{:,.0f}"),
    ("update tokens/s", "update_tok_s", "{:,.0f}"),
    ("mean completion length (tokens)", "mean_len", "{:.1f}"),
    ("peak memory (MiB; CPU: RSS, GPU: allocated)", "peak_mib", "{:,.0f}"),
    ("RSS after setup (MiB)", "setup_rss_mib", "{:,.0f}"),
    ("fraction of FLOP limit, step", "flop_frac", "{:.1%}"),
    ("fraction of FLOP limit, rollout", "rollout_flop_frac", "{:.1%}"),
    ("fraction of FLOP limit, update", "update_flop_frac", "{:.1%}"),
]


def print_table(values: dict[str, tuple[float | None, float | None]], formats: dict[str, str]) -> None:
    """One row per metric: sgrpo, TRL and their ratio."""
    print("| metric | sgrpo | TRL | sgrpo / TRL |\n|---|---:|---:|---:|")
    for label, (a, b) in values.items():
        fmt = formats.get(label, "{:,.1f}")
        cells = ["n/a" if v is None else fmt.format(v) for v in (a, b)]
        ratio = f"{a / b:.2f}" if a is not None and b else "n/a"
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
