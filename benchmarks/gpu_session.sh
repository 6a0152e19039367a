#!/usr/bin/env bash
# Every check sgrpo needs from a GPU, in priority order, each under its own time limit, in ~12 minutes:
# for a session that has a GPU for minutes. Logs go to $OUT (default gpu_logs/), one file per part, and
# a summary of their last lines to $OUT/summary.txt. Runs with the machine's python3 (or $PY); on a
# machine without registry access, bring the missing wheels in .whl/ (docs/scaling.md, "A GPU session").
#   OUT=/path/to/logs bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
date -u +"GPU session %Y-%m-%dT%H:%MZ" | tee "$OUT/summary.txt"
nvidia-smi -L 2>&1 | tee -a "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...: run, log, and record the exit status and the last lines
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    printf '\n## %s: exit %s in %ss\n' "$name" "$status" "$((SECONDS - started))" >>"$OUT/summary.txt"
    grep -v -i "warn" "$OUT/$name.log" | tail -n 15 >>"$OUT/summary.txt"
}

# 1. correctness and the training step on CUDA: the quickstart (it crashed at step 1 before the device fix)
part quickstart 150 "$PY" -m sgrpo.fit --config configs/quickstart.yaml --trainer.accelerator=gpu \
    --trainer.default_root_dir="$OUT/quickstart" --trainer.enable_progress_bar=false
# 2. the 0.44B smoke: decoders (greedy agreement, CUDA-graph steps, tokens/s), then FSDP2 fits
part gpu_smoke 300 "$PY" benchmarks/gpu_smoke.py
# 3. sgrpo vs TRL on one GPU, forced length, bf16-mixed: eager decode, then CUDA-graph decode steps
BENCH=(--device cuda --prompts 16 --group-size 8 --new-tokens 256 --force-length --hidden 1024 --layers 24
    --heads 16 --intermediate 4096 --warmup 1 --steps 3)
part throughput 200 "$PY" benchmarks/throughput.py "${BENCH[@]}"
part throughput_graphs 150 "$PY" benchmarks/throughput.py "${BENCH[@]}" --sgrpo-cuda-graphs
cat "$OUT/summary.txt"
