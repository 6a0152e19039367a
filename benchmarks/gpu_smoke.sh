#!/usr/bin/env bash
# One-GPU smoke check (< 5 minutes): FSDP2 fit steps of a ~0.44B Llama with HF and vLLM rollouts, printing
# rollout / update tokens/s and model FLOP utilisation. Assumes `make install` was run (.venv/), and
# `pip install -e '.[vllm]'` for the vLLM part. Options go to benchmarks/gpu_smoke.py (--help).
#   bash benchmarks/gpu_smoke.sh                # on a GPU machine
#   bash benchmarks/gpu_smoke.sh --tiny --cpu   # the same code path at toy size, on CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [[ ! -x $PY ]]; then
    echo "error: $PY not found: run 'make install' first" >&2
    exit 2
fi
if [[ " $* " != *" --cpu "* ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no NVIDIA GPU visible (nvidia-smi lists none); use --tiny --cpu for the CPU check" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
exec timeout "${SMOKE_TIMEOUT:-300}" "$PY" benchmarks/gpu_smoke.py "$@"
